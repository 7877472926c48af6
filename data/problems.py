"""The built-in rule-checked task: prompts generated in code, answers checked by rule, no downloads.

Three generators, all small enough for a 2-layer character LM to improve on within minutes of CPU:

- ``count``: ``"c4="`` → ``"cccc"`` (repeat a letter k times);
- ``copy``:  ``"copy:abc="`` → ``"abc"``;
- ``arith``: ``"12+7="`` → ``"19"``.

The reward is dense so that GRPO groups have spread from the first step: the matched prefix of
the answer plus the end-of-sequence token, as a fraction of answer length + 1 (1.0 = exact).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

PAD, BOS, EOS = 0, 1, 2
_SPECIAL = ["<pad>", "<bos>", "<eos>"]
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789+-=:?., "


class CharTokenizer:
    """Characters ↔ ids; ids 0-2 are <pad>, <bos>, <eos>."""

    def __init__(self, chars: str = _CHARS):
        self.itos = [*_SPECIAL, *chars]
        self.stoi = {ch: i for i, ch in enumerate(self.itos) if i >= len(_SPECIAL)}
        self.pad_id, self.bos_id, self.eos_id = PAD, BOS, EOS

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        try:
            ids = [self.stoi[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None
        return [BOS, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text up to the first <eos>; special tokens dropped."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= len(_SPECIAL):
                out.append(self.itos[i])
        return "".join(out)


@dataclass(frozen=True)
class Problem:
    index: int
    prompt: str
    answer: str


def make_problems(name: str, num: int, seed: int) -> list[Problem]:
    """``num`` problems of task ``name``, the same for the same seed."""
    rng = random.Random(f"{name}:{seed}")
    make = {"count": _count, "copy": _copy, "arith": _arith}.get(name)
    if make is None:
        raise ValueError(f"unknown task {name!r}; known: arith, copy, count")
    return [Problem(i, *make(rng)) for i in range(num)]


def _count(rng: random.Random) -> tuple[str, str]:
    ch, k = rng.choice("abcde"), rng.randint(1, 6)
    return f"{ch}{k}=", ch * k


def _copy(rng: random.Random) -> tuple[str, str]:
    s = "".join(rng.choice("abcdef") for _ in range(rng.randint(1, 5)))
    return f"copy:{s}=", s


def _arith(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return f"{a}+{b}=", str(a + b)


def reward(problem: Problem, response_ids: Sequence[int], tokenizer: CharTokenizer) -> float:
    """Matched prefix of (answer + <eos>) / (len(answer) + 1); exactly right = 1.0."""
    target = [*tokenizer.encode(problem.answer, bos=False), EOS]
    matched = 0
    for got, want in zip(response_ids, target):
        if got != want:
            break
        matched += 1
    return matched / len(target)


def prompt_stream(
    problems: Sequence[Problem],
    tokenizer: CharTokenizer,
    *,
    epochs: int,
    seed: int,
    skip: Iterable[tuple[int, int]] = (),
    limit: int | None = None,
) -> Iterator[tuple[int, int, list[int]]]:
    """(epoch, prompt index, prompt tokens) in a seeded per-epoch order.

    ``skip`` holds the (epoch, index) pairs already trained on (resume); ``limit`` caps the total
    number of prompts across epochs *including* skipped ones, so a resumed run stops at the same
    place as an uninterrupted one.
    """
    for epoch, index in epoch_order(len(problems), epochs=epochs, seed=seed, skip=skip, limit=limit):
        yield epoch, index, tokenizer.encode(problems[index].prompt)


def epoch_order(
    num: int,
    *,
    epochs: int,
    seed: int,
    shuffle: bool = True,
    skip: Iterable[tuple[int, int]] = (),
    limit: int | None = None,
) -> Iterator[tuple[int, int]]:
    """(epoch, index) over ``num`` prompts: a seeded order per epoch (file order without
    ``shuffle``), minus ``skip``; ``limit`` counts skipped pairs too (see ``prompt_stream``)."""
    done = set(skip)
    emitted = 0
    for epoch in range(epochs):
        order = list(range(num))
        if shuffle:
            random.Random(f"order:{seed}:{epoch}").shuffle(order)
        for index in order:
            if limit is not None and emitted >= limit:
                return
            emitted += 1
            if (epoch, index) in done:
                continue
            yield epoch, index
