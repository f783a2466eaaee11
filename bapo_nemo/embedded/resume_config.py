"""May a checkpoint be resumed with this run's config? The keys whose values differ, read through today's
schema so that a key added since the checkpoint was written compares as its default."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from bapo_nemo.embedded import config_keys
from bapo_nemo.embedded.config import RunConfig, deep_merge

# Keys that may differ between a checkpoint and the resumed run: they change how long or how visibly the
# run goes, not what it computes.
RESUME_HARMLESS_KEYS = (
    "grpo.max_num_steps",
    "checkpointing.",
    "grpo.val_period",
    "logger.",
    "tracking.",
    "runtime.",
)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`, values as they are (tracking.redact.flatten turns them into
    MLflow's cut-off strings, which could hide a difference)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict, current: dict) -> list[str]:
    """Keys whose values differ (ignoring RESUME_HARMLESS_KEYS), as `key: checkpoint=X, now=Y`.

    The checkpoint's config is first read through today's schema, so a key added since it was written
    (absent there) compares as its default: a code update between two requeues does not block resume
    unless the run sets that key to something else.
    """
    saved = config_keys.upgrade(saved)  # a checkpoint written before the keys took NeMo-RL's names
    try:
        saved = RunConfig.model_validate(deep_merge(RunConfig().to_dict(), saved)).to_dict()
    except ValidationError:
        pass  # a key was removed since: compare as written, the message names it
    a, b = _flatten(saved), _flatten(current)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if any(key == h or (h.endswith(".") and key.startswith(h)) for h in RESUME_HARMLESS_KEYS):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            diffs.append(f"{key}: checkpoint={a.get(key, '<absent>')!r}, now={b.get(key, '<absent>')!r}")
    return diffs
