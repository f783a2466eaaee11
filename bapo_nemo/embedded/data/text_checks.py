"""Whether text survives the run's tokenizer: encode, decode, compare. What the model sees of a row is what
comes back, and a tokenizer may turn what it does not know into its unknown token or drop it without a
trace: transformers 5 loads the bundled character vocabulary saved beside a Qwen2 config as
`Qwen2Tokenizer`, which turns `What is 3 + 4?` into `3+4?`. So the check is the round trip, with the
tokenizer the run loaded, whatever its class; looking for the unknown token alone misses the drops."""

from __future__ import annotations

import difflib

CANNOT_REPRESENT = "characters the tokenizer cannot represent"


def round_trip(tokenizer, text: str) -> str:
    """`text` as the model sees it: encoded without special tokens, decoded as it was written."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def lost_characters(tokenizer, text: str) -> tuple[str, str]:
    """(the characters of `text` that do not come back from the round trip, sorted, each once; what came
    back). ("", ...) when the text survives. Whitespace at either end may be normalised (SentencePiece's
    leading space), and characters a decoder only adds lose nothing, so neither counts."""
    back = round_trip(tokenizer, text)
    if back == text or back.strip() == text.strip():
        return "", back
    matcher = difflib.SequenceMatcher(None, text, back, autojunk=False)
    lost = {c for tag, i1, i2, _, _ in matcher.get_opcodes() if tag in ("delete", "replace") for c in text[i1:i2]}
    return "".join(sorted(lost)), back


def representation_problem(tokenizer, text: str, what: str) -> str | None:
    """Why `what` (e.g. "prompt") cannot be trained on as written, or None."""
    lost, back = lost_characters(tokenizer, text)
    if not lost:
        return None
    return (f"{what} has {CANNOT_REPRESENT}: {lost!r} ({_short(text)!r} comes back from "
            f"{type(tokenizer).__name__} as {_short(back)!r})")


def _short(text: str, most: int = 60) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."
