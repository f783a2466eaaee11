"""Flattening of nested configs into MLflow params, and redaction of secrets before anything leaves
the process.

A key is secret when its last word is a secret word (`hf_token`, `api_key`) or it contains an unambiguous
one (`secret`, `password`, `credential`); values that look like known token formats or URLs with a
password are redacted whatever their key. `redact_nested` for structured records, `redact_text` for free
text, `RedactingFilter` for log handlers."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***redacted***"

# Last word of the key (split on _ . - / and camelCase) that marks a secret.
_SECRET_LAST_WORDS = {
    "token", "key", "keys", "secret", "secrets", "password", "passwd", "pwd", "passphrase",
    "credential", "credentials", "apikey", "auth",
}
# Substrings that mark a secret anywhere in the key (lower-cased, separators removed).
_SECRET_ANYWHERE = ("secret", "password", "passwd", "credential", "apikey", "accesskey", "privatekey",
                    "authtoken", "accesstoken", "bearer")
# Tokenizer special-token settings are text like "<|endoftext|>", not secrets.
_NOT_SECRET_KEYS = {
    "pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token",
    "additional_special_tokens", "chat_template",
}
# Values that are secrets whatever their key, wherever they stand in a text: Hugging Face, OpenAI-style,
# GitHub, AWS, Slack-style tokens.
_TOKEN = (r"hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|AKIA[0-9A-Z]{16}|"
          r"xox[abpr]-[A-Za-z0-9\-]{10,}")
_TOKEN_IN_TEXT = re.compile(rf"(?<![A-Za-z0-9])(?:{_TOKEN})(?![A-Za-z0-9])")
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^:/@\s]+):(?P<pw>[^@/\s]+)@")

MAX_PARAM_VALUE_LENGTH = 6000  # MLflow 2.x/3.x server limit for one param value


def _words(key: str) -> list[str]:
    key = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)
    return [w for w in re.split(r"[_.\-/\s]+", key.lower()) if w]


def is_secret_key(key: str) -> bool:
    """True for a flattened key (``a.b.hf_token``) whose last component names a secret."""
    last = key.rsplit(".", 1)[-1]
    if last.lower() in _NOT_SECRET_KEYS:
        return False
    words = _words(last)
    if words and words[-1] in _SECRET_LAST_WORDS:
        return True
    squashed = "".join(words)
    return any(marker in squashed for marker in _SECRET_ANYWHERE)


def redact_text(text: str) -> str:
    """``text`` with every secret recognisable by its shape replaced: known token formats anywhere in it,
    the password of a URL (``http://user:***redacted***@host``). A 40-hex string is what a git commit
    looks like, so only its key can mark it secret."""
    text = _TOKEN_IN_TEXT.sub(REDACTED, text)
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)



def redact(flat: Mapping[str, str]) -> dict[str, str]:
    """Return a copy of a flat str->str mapping with every secret value replaced by ``***redacted***``."""
    return {k: (REDACTED if is_secret_key(k) and v not in ("", "None") else redact_text(v)) for k, v in flat.items()}


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value), default=str)
    return str(value)


def flatten(config: Mapping[str, Any], sep: str = ".", prefix: str = "") -> dict[str, str]:
    """Nested mapping -> ``{"a.b.c": "value"}`` with string values (lists as JSON), as MLflow params.

    Over-long values are cut to MLflow's limit with a marker, so one long prompt template cannot make
    the whole ``log_batch`` call fail.
    """
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if hasattr(value, "model_dump"):  # pydantic models inside a config
            value = value.model_dump()
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, sep=sep, prefix=name))
        else:
            text = _to_text(value)
            if len(text) > MAX_PARAM_VALUE_LENGTH:
                marker = "...[truncated]"
                text = text[: MAX_PARAM_VALUE_LENGTH - len(marker)] + marker
            out[name] = text
    return out


def flatten_and_redact(config: Mapping[str, Any]) -> dict[str, str]:
    return redact(flatten(config))


def redact_nested(config: Any) -> Any:
    """A copy of a nested config with secret values redacted (for config files logged as artifacts)."""
    if hasattr(config, "model_dump"):
        config = config.model_dump()
    if isinstance(config, Mapping):
        out = {}
        for key, value in config.items():
            if is_secret_key(str(key)) and not isinstance(value, Mapping) and value not in (None, ""):
                out[key] = REDACTED
            else:
                out[key] = redact_nested(value)
        return out
    if isinstance(config, (list, tuple)):
        return [redact_nested(v) for v in config]
    if isinstance(config, str):
        return redact_text(config)
    return config


class RedactingFilter(logging.Filter):
    """On a log handler: the formatted message of every record goes out with its secrets redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        safe = redact_text(message)
        if safe != message:
            record.msg, record.args = safe, None
        return True
