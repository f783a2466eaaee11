"""pydantic's ValidationError as lines a user can act on: one `where.key: what is wrong` per error.

A leaf module (pydantic only), shared by every config schema: the BAPO block, the partial-rollout block,
the adapter options and the embedded run config."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError


def validation_lines(
    exc: ValidationError,
    where: str = "",
    unknown_key: Callable[[str], str] | None = None,
    missing: str | None = None,
) -> list[str]:
    """`where.key: message` for each error. `unknown_key(key)` words an unknown key (e.g. the allowed keys
    or a did-you-mean), `missing` a required one; a wrong literal shows the value that was given."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden" and unknown_key is not None:
            msg = unknown_key(key)
        elif err["type"] == "missing" and missing is not None:
            msg = missing
        elif err["type"] == "literal_error":
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"{'.'.join(p for p in (where, key) if p) or '(top level)'}: {msg}")
    return lines
