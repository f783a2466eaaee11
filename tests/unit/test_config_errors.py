"""The shared wording of config errors: one `where.key: message` line per pydantic error."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from bapo_nemo.config_errors import validation_lines


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["keep", "exclude"] = "keep"


class Block(BaseModel):
    model_config = ConfigDict(extra="forbid")
    budget: int
    rate: float = 0.5
    inner: Inner = Inner()

    @field_validator("rate")
    @classmethod
    def _in_unit_interval(cls, v: float) -> float:
        if not 0 <= v <= 1:
            raise ValueError("must lie in [0, 1]")
        return v


def _error(data) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        Block.model_validate(data)
    return info.value


def test_each_error_names_its_full_key_and_says_what_to_do():
    exc = _error({"rate": 2.0, "inner": {"mode": "drop"}, "budgte": 3})
    lines = validation_lines(exc, "partial", unknown_key=lambda key: f"unknown key {key!r}; did you mean 'budget'?",
                             missing="required (e.g. budget: 16)")
    assert sorted(lines) == sorted([
        "partial.budget: required (e.g. budget: 16)",
        "partial.rate: must lie in [0, 1]",  # pydantic's "Value error, " prefix is dropped
        "partial.inner.mode: Input should be 'keep' or 'exclude' (got 'drop')",
        "partial.budgte: unknown key 'budgte'; did you mean 'budget'?",
    ])


def test_without_hints_pydantic_words_the_error_and_a_top_level_error_says_so():
    assert validation_lines(_error({"budget": 1, "x": 0})) == ["x: Extra inputs are not permitted"]
    assert validation_lines(_error([1, 2])) == [
        "(top level): Input should be a valid dictionary or instance of Block"
    ]
