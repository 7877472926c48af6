"""Random scenarios for the lending promise: ``draw(n, seed)`` scenarios from one stated distribution.

Owns the distribution that ``benchmarks/bench_sim.py random`` and
``tests/sim/test_sim_random_promise.py`` draw from, and how a drawn scenario becomes a config and a
``SimSpec``. Every scenario is the dynamic seed preset (``config/presets/sim/qwen35-35b-dynamic.yaml``:
Qwen3.5-35B-A3B, n = 16, its fitted speeds and calibrated switch costs) with these values drawn,
each independently, from ``random.Random(seed)``:

=====================  ===============================  ==============================================
parameter              range                            how drawn
=====================  ===============================  ==============================================
TP (GPUs per replica)  4 or 8                           uniform
GPU total              8–128, a multiple of TP,         log-uniform over [max(8, 2·TP), 128], then
                       at least 2·TP                    rounded down to a multiple of TP
split                  trainer = TP … total − TP        uniform over the multiples of TP (every split
                       GPUs                             with one replica each side, as the TP allows)
staleness_threshold    0–1                              0 with probability 1/4 (the new user's
                                                        setting), else uniform on [0, 1], 2 decimals
trigger_parameter_     1–4                              uniform
sync_step
mini-batch             16 per 32 GPUs                   not drawn: total / 2 (the grid's rule)
response length mean   750–12 000 tokens at the start   log-uniform, whole tokens
at the first step
drift of that mean     end = start × 1/3 … ×3           log-uniform factor, the end capped at 24 000
over the run
switch costs           ×0.25–×4 the preset's            one log-uniform factor on hybrid_sync_s,
                                                        activate_s, deactivate_s and rebalance_s
simulation seed        0–4                              uniform (so the scenarios cover several seeds)
=====================  ===============================  ==============================================

Each run is ``STEPS`` steps (cheap: the promise is about the policy's early decisions too, and a
short run is where a wrong lend costs the largest share). Never lending is ``static_fully_async``
on the same dynamic config (the hybrids start asleep and are never lent), as in ``bench_sim.py
grid``. Must not: import anything but ``config``, ``policies`` and ``sim``; read the clock.
"""

from __future__ import annotations

import dataclasses
import math
import random

from config import TidalConfig, load_config
from policies import DynamicSchedulePolicyBase, policy_from_config
from sim.plan import with_policy
from sim.spec import SimSpec, spec_from_config

BASE_PRESET = "sim/qwen35-35b-dynamic"
STEPS = 16
"""Steps per run: 200 scenarios × 3 policies take about a minute on one core."""
NEVER_LEND = "static_fully_async"
SWITCH_KEYS = ("hybrid_sync_s", "activate_s", "deactivate_s", "rebalance_s")
"""The costs a lend cycle pays that a never-lending run does not (scaled by ``switch_factor``)."""


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One drawn scenario: the values drawn over the dynamic seed preset."""

    index: int
    tp: int
    total_gpus: int
    trainer_gpus: int
    staleness: float
    trigger: int
    len_start: float
    len_end: float
    switch_factor: float
    seed: int
    steps: int = STEPS

    @property
    def label(self) -> str:
        return (f"#{self.index} {self.trainer_gpus}+{self.total_gpus - self.trainer_gpus} TP {self.tp} "
                f"staleness {self.staleness:g} trigger {self.trigger} lengths {self.len_start:.0f}→{self.len_end:.0f} "
                f"switches ×{self.switch_factor:.2f} seed {self.seed}")

    def params(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)

    def config(self, policy: str) -> TidalConfig:
        """The dynamic seed preset with this scenario's values, running ``policy``. Nodes of TP
        GPUs each, so every split the TP allows lays out; mini-batch 16 per 32 GPUs."""
        overrides = _overrides(self)
        preset = load_config(BASE_PRESET, overrides)
        scaled = [f"sim.{key}={getattr(preset.sim, key) * self.switch_factor}" for key in SWITCH_KEYS]
        return with_policy(load_config(BASE_PRESET, [*overrides, *scaled]), policy, dynamic=True)

    def spec(self, policy: str) -> SimSpec:
        return spec_from_config(self.config(policy))

    def policy(self, policy: str) -> DynamicSchedulePolicyBase:
        return policy_from_config(self.config(policy))


def _overrides(sc: Scenario) -> list[str]:
    """The preset's keys this scenario sets (all but the switch costs, which scale the preset's)."""
    mini = sc.total_gpus // 2
    rollout_gpus = sc.total_gpus - sc.trainer_gpus
    return [
        f"trainer.nnodes={sc.trainer_gpus // sc.tp}", f"trainer.n_gpus_per_node={sc.tp}",
        f"rollout.nnodes={rollout_gpus // sc.tp}", f"rollout.n_gpus_per_node={sc.tp}",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={sc.tp}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"async_training.staleness_threshold={sc.staleness}",
        f"async_training.trigger_parameter_sync_step={sc.trigger}",
        f"sim.response_len_mean_start={sc.len_start}", f"sim.response_len_mean_end={sc.len_end}",
        f"trainer.total_training_steps={sc.steps}",
        f"rollout.total_rollout_steps={sc.steps * mini * sc.trigger}",
    ]


def draw(n: int, seed: int = 0, steps: int = STEPS) -> list[Scenario]:
    """``n`` scenarios from the module's distribution, reproducibly from ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tp = rng.choice((4, 8))
        lo = max(8, 2 * tp)
        total = max(lo, int(_log_uniform(rng, lo, 128)) // tp * tp)
        trainer = tp * rng.randint(1, total // tp - 1)
        staleness = 0.0 if rng.random() < 0.25 else round(rng.uniform(0.0, 1.0), 2)
        trigger = rng.randint(1, 4)
        start = round(_log_uniform(rng, 750.0, 12_000.0))
        end = round(min(24_000.0, start * _log_uniform(rng, 1 / 3, 3.0)))
        factor = round(_log_uniform(rng, 0.25, 4.0), 3)
        out.append(Scenario(i, tp, total, trainer, staleness, trigger, float(start), float(end), factor,
                            rng.randint(0, 4), steps))
    return out
