"""Fit the cost model's two speed scales to two measured static wall clocks.

A train-bound baseline (few trainer GPUs) pins the trainer's speed, a rollout-bound one (few
rollout GPUs) pins the replicas' decode speed. ``fit_speeds`` alternates two fixed-point updates
until both simulated wall clocks match: ``train_tokens_per_gpu_s *= simulated / target`` on the
train-bound setup, and both decode-iteration costs ``*= target / simulated`` on the rollout-bound
one (each side's time is close to inversely proportional to its speed). Everything else in the
cost model stays as configured; docs/simulator.md says how the presets were fitted with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from policies import build_policy
from sim.simulator import simulate_spec
from sim.spec import SimSpec


@dataclass(frozen=True)
class Fit:
    """The fitted speeds and the wall clocks they give."""

    train_tokens_per_gpu_s: float
    decode_step_base_s: float
    decode_step_per_seq_s: float
    train_bound_s: float
    rollout_bound_s: float
    rounds: int


def _wall(spec: SimSpec, seed: int) -> float:
    policy = build_policy("static_fully_async", deactivate_ratio=0.0, only_hybrid=spec.only_hybrid)
    return simulate_spec(spec, policy, seed=seed).wall_clock_s


def fit_speeds(
    train_bound: SimSpec,
    train_target_s: float,
    rollout_bound: SimSpec,
    rollout_target_s: float,
    *,
    seed: int = 0,
    rtol: float = 1e-3,
    max_rounds: int = 20,
) -> Fit:
    """Scale the trainer and decode speeds of both specs until each hits its target wall clock."""
    alpha = train_bound.train_tokens_per_gpu_s
    base, per_seq = rollout_bound.decode_step_base_s, rollout_bound.decode_step_per_seq_s

    def apply(spec: SimSpec) -> SimSpec:
        return dataclasses.replace(
            spec, train_tokens_per_gpu_s=alpha, decode_step_base_s=base, decode_step_per_seq_s=per_seq
        )

    for rounds in range(1, max_rounds + 1):
        t_train = _wall(apply(train_bound), seed)
        alpha *= t_train / train_target_s
        t_roll = _wall(apply(rollout_bound), seed)
        base *= rollout_target_s / t_roll
        per_seq *= rollout_target_s / t_roll
        if abs(t_train / train_target_s - 1) < rtol and abs(t_roll / rollout_target_s - 1) < rtol:
            break
    return Fit(
        train_tokens_per_gpu_s=alpha,
        decode_step_base_s=base,
        decode_step_per_seq_s=per_seq,
        train_bound_s=_wall(apply(train_bound), seed),
        rollout_bound_s=_wall(apply(rollout_bound), seed),
        rounds=rounds,
    )
