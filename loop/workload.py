"""The rollout workload: response lengths (long-tailed, correlated within a prompt, drifting over
training) and what a replica's decode costs.

Owns the one length model and the one replica cost rule of the simulator and the emulated
cluster's simulated engine; the
formula is in ``docs/simulator.md`` ("Workload"). Must not hold a random stream of its own: the
simulator draws from its seeded ``random.Random`` in event order, the engine from generators keyed
by ``(seed, request id)`` (``SeededLengths``), so the same model serves both.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LengthModel:
    """``exp(mu + z_prompt + z_response)`` rounded and clipped to ``[1, max_len]``.

    ``z_prompt ~ N(0, prompt_sigma)`` is shared by a sample's responses, ``z_response ~ N(0,
    response_sigma)`` is per response, and ``mu`` makes the unclipped mean ``mean(version)``,
    which moves linearly from ``mean_start`` (version 0) to ``mean_end`` (``last_version``, the
    run's last step). With both sigmas 0 every length is ``round(mean)`` and nothing is drawn.
    """

    mean_start: float
    mean_end: float
    response_sigma: float
    prompt_sigma: float
    max_len: int
    last_version: int

    @property
    def deterministic(self) -> bool:
        return self.prompt_sigma == 0.0 and self.response_sigma == 0.0

    def mean(self, version: int) -> float:
        """Unclipped mean response length of a sample started at ``version``."""
        frac = min(1.0, version / self.last_version) if self.last_version > 0 else 1.0
        return self.mean_start + (self.mean_end - self.mean_start) * frac

    def mu(self, version: int) -> float:
        sp, sr = self.prompt_sigma, self.response_sigma
        return math.log(self.mean(version)) - (sp * sp + sr * sr) / 2

    def clip(self, length: float) -> int:
        return min(self.max_len, max(1, round(length)))

    def draw(self, rng: random.Random, n: int, version: int) -> list[int]:
        """The ``n`` lengths of one sample, drawn from ``rng`` (prompt factor first)."""
        if self.deterministic:
            return [self.clip(self.mean(version))] * n
        sp, sr, gauss = self.prompt_sigma, self.response_sigma, rng.gauss
        mu = self.mu(version) + (gauss(0.0, sp) if sp else 0.0)
        return [self.clip(math.exp(mu + gauss(0.0, sr) if sr else mu)) for _ in range(n)]


@dataclass(frozen=True)
class SeededLengths(LengthModel):
    """``lengths(request_id, version)``: a pure function of ``(seed, request id, version)``.

    The prompt factor is keyed by ``prompt_key(request_id)`` (the sample a response belongs to),
    the response factor by the request id, so retries and other replicas draw the same length.
    Picklable when ``prompt_key`` is a module-level function.
    """

    seed: int = 0
    prompt_key: Callable[[str], str] = str

    def __call__(self, request_id: str, version: int) -> int:
        if self.deterministic:
            return self.clip(self.mean(version))
        sp, sr, mu = self.prompt_sigma, self.response_sigma, self.mu(version)
        if sp:
            mu += random.Random(f"{self.seed}:{self.prompt_key(request_id)}:prompt").gauss(0.0, sp)
        if sr:
            mu += random.Random(f"{self.seed}:{request_id}:response").gauss(0.0, sr)
        return self.clip(math.exp(mu))


@dataclass(frozen=True)
class ReplicaCosts:
    """One replica's decode costs: an iteration over ``b`` running sequences takes
    ``(base_s + per_seq_s × b) / speed`` s, prefill ``tokens / (prefill_tokens_per_s × speed)``."""

    base_s: float
    per_seq_s: float
    speed: float
    max_num_seqs: int


def replica_costs(sim: Any, *, hybrid: bool) -> ReplicaCosts:
    """The costs of a standalone or hybrid replica from a cost model with the ``sim.*`` names
    (``config.SimSection`` or ``sim.SimSpec``): speculative decoding (``speculative_speedup``
    tokens per sequence and iteration) divides both iteration terms, and a hybrid runs at
    ``hybrid_throughput_factor`` with ``hybrid_max_num_seqs`` (0 = ``max_num_seqs``)."""
    mtp = sim.speculative_speedup
    seqs = (sim.hybrid_max_num_seqs or sim.max_num_seqs) if hybrid else sim.max_num_seqs
    return ReplicaCosts(base_s=sim.decode_step_base_s / mtp, per_seq_s=sim.decode_step_per_seq_s / mtp,
                        speed=sim.hybrid_throughput_factor if hybrid else 1.0, max_num_seqs=seqs)
