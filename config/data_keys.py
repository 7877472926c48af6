"""Config sections for datasets, reward functions and validation (verl's key names and defaults).

Owns: `data.*`, `custom_reward_function.*` and `actor_rollout_ref.rollout.val_kwargs.*`, with their
limits. Must not: read files or import anything of ours beyond the section base (whether the
files exist and their rows are valid is checked by `data.datasets` when the CLI checks a config).
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class DataSection(_Section):
    """`data.*`: the prompt dataset in verl's row schema (`data_source`, `prompt`, `ability`,
    `reward_model.ground_truth`, `extra_info`)."""

    train_files: list[str] | None = None
    """Training parquet or jsonl file(s): one path or a list. None = the built-in task
    (`task.*`), served through the same dataset class (`data_source: tidal/<task>`)."""

    val_files: list[str] | None = None
    """Validation parquet or jsonl file(s): one path or a list. None = no validation."""

    prompt_key: str = "prompt"
    """Column holding the prompt as chat messages (a list of `{role, content}`) or a plain string."""

    max_prompt_length: int | None = Field(None, ge=1, le=1_000_000)
    """Longest prompt in tokens, chat template applied. None = `actor_rollout_ref.rollout.prompt_length`
    (verl interpolates the other way round; one number is kept in one place)."""

    max_response_length: int | None = Field(None, ge=1, le=1_000_000)
    """Longest response in tokens. None = `actor_rollout_ref.rollout.response_length`."""

    filter_overlong_prompts: bool = False
    """Drop prompts longer than `max_prompt_length` while loading (else `truncation` applies)."""

    truncation: Literal["error", "left", "right", "middle"] = "error"
    """An over-long prompt that was not filtered: `error` stops before the run starts (naming the
    file and row); `left` keeps its last tokens, `right` its first, `middle` both ends."""

    shuffle: bool = True
    """Visit the prompts in a seeded order, a new one every epoch (else file order)."""

    seed: int | None = Field(None, ge=0)
    """Seed of the prompt order and of `train_max_samples`' selection. None = `trainer.seed`."""

    train_max_samples: int = Field(-1, ge=-1)
    """Use this many training rows, chosen at random with the seed (-1 = all)."""

    val_max_samples: int = Field(-1, ge=-1)
    """Use this many validation rows, chosen at random with the seed (-1 = all)."""

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("train_files", "val_files")
    @classmethod
    def _known_format(cls, files: list[str] | None) -> list[str] | None:
        if files is not None:
            if not files:
                raise ValueError("needs at least one file (or null)")
            for path in files:
                if not path.endswith((".parquet", ".jsonl")):
                    raise ValueError(f"{path!r}: only .parquet and .jsonl files are read")
            # absolute against the working directory: every process of the run (and a resume) reads the same files
            files = [os.path.abspath(os.path.expanduser(path)) for path in files]
        return files

    @field_validator("train_max_samples", "val_max_samples")
    @classmethod
    def _not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("0 rows would train on nothing; -1 = all")
        return value


class CustomRewardFunction(_Section):
    """`custom_reward_function.*`: a Python file whose function scores each response
    (`fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`; a dict carries
    `score` and extras that are logged). None = the built-ins, chosen by `data_source`."""

    path: str | None = None
    """The `.py` file that defines the function (None = built-in scorers)."""

    name: str = "compute_score"
    """The function's name in that file."""

    timeout_s: float = Field(30.0, gt=0.0, le=86_400.0)
    """Seconds one call may take (built-in scorers too); a slower call fails the run naming the
    function and the sample."""


class ValKwargs(_Section):
    """`actor_rollout_ref.rollout.val_kwargs.*`: sampling for validation."""

    n: int = Field(1, ge=1, le=1024)
    """Responses per validation prompt (the metric is `val-core/<data_source>/reward/mean@<n>`)."""

    temperature: float = Field(0.0, ge=0.0, le=10.0)
    """Validation sampling temperature."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Validation nucleus mass."""

    do_sample: bool = False
    """Sample; false = greedy, whatever the temperature."""

    @model_validator(mode="after")
    def _greedy_needs_one(self) -> ValKwargs:
        if not self.do_sample and self.n > 1:
            raise ValueError(f"n={self.n} greedy responses would all be the same: set do_sample=true or n=1")
        return self
