"""The prompt dataset: verl's row schema from parquet or jsonl, validated as it loads.

Owns: reading rows (``data_source``, the prompt column as chat messages or a string, ``ability``,
``reward_model.ground_truth``, ``extra_info``), applying the tokenizer's chat template, filtering
and truncating over-long prompts, the ``train_max_samples`` cap, the seeded prompt order, the
built-in tasks as rows of the same schema (``data_source: tidal/<task>``) and writing rows out.
Must not: read a config (``cluster.builders`` turns it into arguments), score responses
(``data.reward``) or import Ray.

A prompt is identified by its position in the loaded dataset (after the cap and the filter), so
the same files and keys give the same ``(epoch, index)`` pairs: resume skips the consumed ones.
Every error is one line naming the file, the row (1-based) and the column.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from data.problems import epoch_order, make_problems

Truncation = Literal["error", "left", "right", "middle"]
REQUIRED_COLUMNS = ("data_source", "reward_model")


class DatasetError(ValueError):
    """A dataset the run cannot use; ``str()`` is one line naming the file, row and column."""


class PromptTokenizer(Protocol):
    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...


@dataclass(frozen=True)
class Row:
    """One validated row; ``index`` is its prompt index in the dataset."""

    index: int
    data_source: str
    prompt: Any
    ground_truth: Any
    ability: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: tuple[int, ...] = ()
    origin: str = ""
    """``file:row`` it came from (for error messages)."""


def prompt_ids(tokenizer: PromptTokenizer, prompt: Any) -> list[int]:
    """Token ids of a prompt: chat messages through the tokenizer's chat template (with the
    generation prompt) when it has one, else the messages' contents; a string is encoded as is."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    template = getattr(tokenizer, "apply_chat_template", None)
    if template is not None:
        text = template(list(prompt), add_generation_prompt=True, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode("\n".join(m["content"] for m in prompt)))


def truncate(ids: Sequence[int], max_len: int, mode: Truncation) -> list[int]:
    """``ids`` cut to ``max_len``: ``left`` keeps the end, ``right`` the start, ``middle`` both
    ends (the first half rounded down); ``error`` raises ``ValueError``."""
    ids = list(ids)
    if len(ids) <= max_len:
        return ids
    if mode == "left":
        return ids[-max_len:]
    if mode == "right":
        return ids[:max_len]
    if mode == "middle":
        head = max_len // 2
        return ids[:head] + ids[len(ids) - (max_len - head):]
    raise ValueError(f"{len(ids)} tokens > {max_len}")


class RLDataset:
    """Rows in verl's schema, tokenized, filtered, truncated and capped as they load."""

    def __init__(
        self,
        rows: Iterable[tuple[str, Mapping[str, Any]]],
        tokenizer: PromptTokenizer,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int,
        filter_overlong_prompts: bool = False,
        truncation: Truncation = "error",
        max_samples: int = -1,
        shuffle: bool = True,
        seed: int = 0,
        key: str = "data.train_files",
    ) -> None:
        """``rows``: (origin ``file:row``, raw row) pairs. ``key`` names the config key in errors."""
        raw = list(rows)
        if 0 < max_samples < len(raw):
            picked = sorted(random.Random(f"samples:{seed}").sample(range(len(raw)), max_samples)) if shuffle \
                else range(max_samples)
            raw = [raw[i] for i in picked]
        self.rows: list[Row] = []
        self.filtered = 0
        for origin, row in raw:
            parsed = _parse_row(origin, row, prompt_key, key)
            try:
                ids = prompt_ids(tokenizer, parsed.prompt)
            except ValueError as exc:
                raise DatasetError(f"{key}: {origin}: column {prompt_key!r}: cannot tokenize: "
                                   f"{' '.join(str(exc).split())}") from None
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.filtered += 1
                    continue
                if truncation == "error":
                    raise DatasetError(
                        f"{key}: {origin}: column {prompt_key!r}: prompt has {len(ids)} tokens > "
                        f"max_prompt_length {max_prompt_length} (set data.filter_overlong_prompts or data.truncation)")
                ids = truncate(ids, max_prompt_length, truncation)
            self.rows.append(Row(len(self.rows), parsed.data_source, parsed.prompt, parsed.ground_truth,
                                 parsed.ability, parsed.extra_info, tuple(ids), origin))
        if not self.rows:
            raise DatasetError(f"{key}: no prompt left after filtering {self.filtered} over-long one(s)")
        self._shuffle = shuffle
        self._seed = seed

    @classmethod
    def from_files(cls, files: Sequence[str], tokenizer: PromptTokenizer, **kwargs: Any) -> RLDataset:
        """Every row of every file, in order (all files are read and checked before any prompt is
        tokenized)."""
        key = kwargs.get("key", "data.train_files")
        rows = [pair for path in files for pair in read_rows(path, key=key)]
        return cls(rows, tokenizer, **kwargs)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]

    def prompt_stream(
        self, *, epochs: int, skip: Iterable[tuple[int, int]] = (), limit: int | None = None
    ) -> Iterator[tuple[int, int, list[int]]]:
        """(epoch, prompt index, prompt tokens) in the seeded per-epoch order (the order
        ``data.problems.prompt_stream`` gives the built-in tasks), minus ``skip``."""
        for epoch, index in epoch_order(len(self.rows), epochs=epochs, seed=self._seed, shuffle=self._shuffle,
                                        skip=skip, limit=limit):
            yield epoch, index, list(self.rows[index].prompt_tokens)


def _parse_row(origin: str, row: Mapping[str, Any], prompt_key: str, key: str) -> Row:
    if not isinstance(row, Mapping):
        raise DatasetError(f"{key}: {origin}: a row must be a mapping of columns, got {type(row).__name__}")
    for column in (*REQUIRED_COLUMNS, prompt_key):
        if column not in row or row[column] is None:
            raise DatasetError(f"{key}: {origin}: missing column {column!r}")
    source = row["data_source"]
    if not isinstance(source, str) or not source:
        raise DatasetError(f"{key}: {origin}: column 'data_source' must be a non-empty string")
    prompt = row[prompt_key]
    if not isinstance(prompt, str):
        prompt = list(prompt) if isinstance(prompt, Sequence) else prompt
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            raise DatasetError(f"{key}: {origin}: column {prompt_key!r} must be a string or a non-empty list of "
                               "{role, content} messages")
        prompt = [{"role": m["role"], "content": m["content"]} for m in prompt]
    reward_model = row["reward_model"]
    if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
        raise DatasetError(f"{key}: {origin}: missing column 'reward_model.ground_truth'")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, Mapping):
        raise DatasetError(f"{key}: {origin}: column 'extra_info' must be a mapping")
    return Row(-1, source, prompt, reward_model["ground_truth"], str(row.get("ability") or ""), dict(extra))


def read_rows(path: str, *, key: str = "data.train_files") -> list[tuple[str, dict[str, Any]]]:
    """(``file:row``, row) for every row of a parquet or jsonl file; a missing, unreadable or
    empty file is a ``DatasetError``."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DatasetError(f"{key}: {path}: no such file")
    if file.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq

            rows = pq.read_table(file).to_pylist()
        except Exception as exc:  # noqa: BLE001 - any reader failure is bad input, in one line
            raise DatasetError(f"{key}: {path}: not a readable parquet file ({' '.join(str(exc).split())})") from None
    elif file.suffix == ".jsonl":
        rows = []
        with file.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{key}: {path}:{lineno}: not JSON ({exc.msg})") from None
    else:
        raise DatasetError(f"{key}: {path}: only .parquet and .jsonl files are read")
    if not rows:
        raise DatasetError(f"{key}: {path}: the file has no rows")
    return [(f"{path}:{i}", row) for i, row in enumerate(rows, 1)]


def task_rows(name: str, num: int, seed: int) -> list[dict[str, Any]]:
    """The built-in task ``name`` (``data.problems``) as rows of verl's schema, one per problem
    in problem order: ``data_source: tidal/<name>``, the prompt as one user message."""
    return [
        {
            "data_source": f"tidal/{name}",
            "prompt": [{"role": "user", "content": p.prompt}],
            "ability": "tidal",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"index": p.index, "split": "train"},
        }
        for p in make_problems(name, num, seed)
    ]


def write_rows(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows to ``.parquet`` or ``.jsonl`` (through a temporary file: never half-written)."""
    out = Path(path)
    if out.suffix not in (".parquet", ".jsonl"):
        raise DatasetError(f"{out}: only .parquet and .jsonl files are written")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        if out.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
        else:
            with tmp.open("w", encoding="utf-8") as fh:
                for row in rows:
                    fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(path: str, *, split: str = "train", limit: int | None = None) -> list[dict[str, Any]]:
    """GSM8K's jsonl (``question``, ``answer`` ending in ``#### n``) as rows of verl's schema:
    ``data_source: openai/gsm8k``, the question plus the ``####`` instruction as one user message,
    ground truth ``n`` (commas dropped). A row without ``#### n`` is a ``DatasetError``."""
    rows = []
    for origin, raw in read_rows(path, key="gsm8k")[:limit]:
        for column in ("question", "answer"):
            if not isinstance(raw.get(column), str):
                raise DatasetError(f"gsm8k: {origin}: missing column {column!r}")
        head, sep, tail = raw["answer"].rpartition("####")
        truth = tail.strip().replace(",", "")
        if not sep or not truth:
            raise DatasetError(f"gsm8k: {origin}: column 'answer' does not end in '#### <number>'")
        index = len(rows)
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{raw['question']} {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "answer": raw["answer"], "question": raw["question"]},
        })
    return rows
