"""`actor_rollout_ref.model.*`: which Hugging Face model a run trains and serves (verl's key names).

Owns the model section, the rollout dtype type and the one check the schema can make of a model
folder without loading it: the folder exists and its ``config.json`` names a decoder-only causal LM.
Relative folders are made absolute (against the working directory) as they are validated.
Must not import torch or transformers (the config package stays light).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

RolloutDtype = Literal["float32", "bfloat16", "float16"]
"""`actor_rollout_ref.rollout.dtype`: the dtype the rollout engine holds the weights in."""

_DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")


class HFModelSection(BaseModel):
    """`actor_rollout_ref.model.*`: a local Hugging Face model folder, or the built-in tiny LM."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    path: str | None = None
    """A local Hugging Face model folder (any decoder-only `AutoModelForCausalLM`); null = the
    built-in tiny LM (`model.*`). Nothing is downloaded."""

    tokenizer_path: str | None = None
    """A local tokenizer folder; null = `path`."""

    custom_chat_template: str | None = None
    """A Jinja chat template that replaces the tokenizer's own; null = keep the tokenizer's."""

    trust_remote_code: bool = False
    """Let transformers run Python code shipped in the model folder."""

    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, more compute) when training."""

    @field_validator("path")
    @classmethod
    def _a_decoder_only_folder(cls, path: str | None) -> str | None:
        if path is not None:
            check_model_folder(path)
        return absolute(path)

    @field_validator("tokenizer_path")
    @classmethod
    def _an_existing_folder(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).expanduser().is_dir():
            raise ValueError(f"tokenizer folder {path!r} does not exist")
        return absolute(path)

    @model_validator(mode="after")
    def _hf_keys_need_a_model(self) -> HFModelSection:
        if self.path is None and self.tokenizer_path is not None:
            raise ValueError("tokenizer_path is set but path is null (the built-in tiny LM has its own tokenizer)")
        return self

    @property
    def tokenizer_folder(self) -> str | None:
        """Where the tokenizer loads from: `tokenizer_path`, else `path`."""
        return self.tokenizer_path or self.path


def absolute(path: str | None) -> str | None:
    """``path`` made absolute against the working directory (``~`` expanded): the resolved config
    names the same folder from every process of the run (Ray workers do not share the CLI's
    working directory) and on resume."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def check_model_folder(path: str) -> None:
    """Raise ``ValueError`` (one line) unless ``path`` is a folder whose ``config.json`` describes a
    decoder-only causal LM (an architecture ending in ``ForCausalLM``/``LMHeadModel``, not an
    encoder-decoder)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ValueError(f"model folder {path!r} does not exist")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model folder {path!r} has no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file}: unreadable config.json ({exc})") from None
    architectures = config.get("architectures") or []
    if config.get("is_encoder_decoder") or not any(a.endswith(_DECODER_SUFFIXES) for a in architectures):
        raise ValueError(f"model folder {path!r} is not a decoder-only causal LM (architectures: {architectures}, "
                         f"model_type: {config.get('model_type')!r})")
