"""Config → datasets and the reward scorer, without Ray (so the CLI's config check can build them).

The half of ``cluster.builders`` that the check before a run needs: ``check_data`` loads every
dataset and the reward function exactly as the run will, so a bad file, column or prompt, or a
reward function that cannot be loaded, fails in one line before anything starts.
Must not: import Ray, torch or the actors.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from config import TidalConfig
from data.datasets import DatasetError, RLDataset, task_rows
from data.problems import CharTokenizer
from data.reward import SampleScorer, ScoreFn, check_builtin, load_reward_function


def tokenizer_for(cfg: TidalConfig) -> Any:
    """The tokenizer of the run's model: the HF folder's (``tokenizer_path``, else ``path``, with
    ``custom_chat_template`` applied) when ``actor_rollout_ref.model.path`` is set, else the
    built-in character tokenizer. Prompts go through its chat template (``data.datasets``)."""
    m = cfg.actor_rollout_ref.model
    if m.path is None:
        return CharTokenizer()
    from models.hf import load_tokenizer

    return load_tokenizer(m.tokenizer_folder, custom_chat_template=m.custom_chat_template,
                          trust_remote_code=m.trust_remote_code)


def max_seq_len(cfg: TidalConfig) -> int | None:
    """The longest prompt + response the run's model takes: the HF folder's
    ``max_position_embeddings`` (None when its config.json names none), else ``model.max_seq_len``."""
    path = cfg.actor_rollout_ref.model.path
    if path is None:
        return cfg.model.max_seq_len
    config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) else None


def prompt_length(cfg: TidalConfig) -> int:
    """``data.max_prompt_length``, else ``actor_rollout_ref.rollout.prompt_length``."""
    return cfg.data.max_prompt_length or cfg.actor_rollout_ref.rollout.prompt_length


def response_length(cfg: TidalConfig) -> int:
    """``data.max_response_length``, else ``actor_rollout_ref.rollout.response_length``."""
    return cfg.data.max_response_length or cfg.actor_rollout_ref.rollout.response_length


def data_seed(cfg: TidalConfig) -> int:
    return cfg.trainer.seed if cfg.data.seed is None else cfg.data.seed


def dataset_for(cfg: TidalConfig, tokenizer: Any, *, split: str = "train") -> RLDataset | None:
    """The run's training dataset (``data.train_files``, else the built-in task as rows of the
    same schema) or its validation dataset (``data.val_files``; None when unset)."""
    d = cfg.data
    files = d.train_files if split == "train" else d.val_files
    kwargs = dict(
        prompt_key=d.prompt_key,
        max_prompt_length=prompt_length(cfg),
        filter_overlong_prompts=d.filter_overlong_prompts,
        truncation=d.truncation,
        max_samples=d.train_max_samples if split == "train" else d.val_max_samples,
        shuffle=d.shuffle if split == "train" else False,
        seed=data_seed(cfg),
        key=f"data.{split}_files",
    )
    if files is not None:
        return RLDataset.from_files(files, tokenizer, **kwargs)
    if split != "train":
        return None
    t = cfg.task
    rows = [(f"task {t.name}:{i}", row) for i, row in enumerate(task_rows(t.name, t.num_prompts, t.seed), 1)]
    return RLDataset(rows, tokenizer, **{**kwargs, "key": "task"})


def reward_function(cfg: TidalConfig) -> tuple[ScoreFn | None, str]:
    """The custom function and its name, or (None, the built-ins' name)."""
    c = cfg.custom_reward_function
    if c.path is None:
        return None, "default_compute_score"
    return load_reward_function(c.path, c.name), f"{c.path}:{c.name}"


def sample_scorer(cfg: TidalConfig, dataset: RLDataset, tokenizer: Any) -> SampleScorer:
    fn, name = reward_function(cfg)
    rows = {r.index: (r.data_source, r.ground_truth, r.extra_info) for r in dataset.rows}
    return SampleScorer(rows, tokenizer, fn=fn, fn_name=name, timeout_s=cfg.custom_reward_function.timeout_s)


def scorer_factory(cfg: TidalConfig) -> functools.partial[SampleScorer]:
    """A picklable zero-argument callable that builds the training scorer where it is called
    (inside the rollout service's actor)."""
    return functools.partial(_build_scorer, cfg)


def _build_scorer(cfg: TidalConfig) -> SampleScorer:
    tokenizer = tokenizer_for(cfg)
    dataset = dataset_for(cfg, tokenizer)
    assert dataset is not None
    return sample_scorer(cfg, dataset, tokenizer)


def check_data(cfg: TidalConfig) -> None:
    """Load the datasets and the reward function as the run will; raises ``DatasetError`` or
    ``RewardConfigError`` (one line each)."""
    longest, limit = prompt_length(cfg) + response_length(cfg), max_seq_len(cfg)
    if cfg.engines.rollout in ("torch", "vllm") and limit is not None and longest > limit:
        what = "model.max_seq_len" if cfg.actor_rollout_ref.model.path is None else \
            f"the max_position_embeddings of {cfg.actor_rollout_ref.model.path}"
        raise DatasetError(f"data.max_prompt_length + max_response_length ({prompt_length(cfg)}+"
                           f"{response_length(cfg)}) exceeds {what}={limit}")
    tokenizer = tokenizer_for(cfg)
    datasets = [ds for ds in (dataset_for(cfg, tokenizer), dataset_for(cfg, tokenizer, split="val")) if ds]
    if cfg.custom_reward_function.path is not None:
        reward_function(cfg)
    else:
        check_builtin([r.data_source for ds in datasets for r in ds.rows])
