"""Discrete-event twin of Tidal's fully-async loop, for planning and for testing policies at scale.

Owns: the event heap (total order ``(time, priority, seq)``), the virtual clock and the seeded
RNG; the cost model of rollout replicas (batch-dependent decode, long-tailed drifting response
lengths, partial-rollout re-prefill), the rollouter's staleness rules, the trainer, weight syncs
and switch costs; production's step (``loop.step_sequence``) with the policy asked through ``loop.Decider``; the
per-step metrics computed by the real ``metrics`` functions; the fluid lower bound; the static
splits a plan compares.

Must not: import anything of ours but ``config``, ``policies``, ``metrics`` and ``loop`` (never ``cluster``),
import Ray, torch or Prefect, read the wall clock, draw randomness from anything but its own
``random.Random(seed)``, or do I/O (printing, plotting and files belong to ``flows/simulate.py``).
The same seed and inputs give the same run, event for event.
"""

from __future__ import annotations

from config import TidalConfig
from policies import DynamicSchedulePolicyBase, policy_from_config
from sim.events import CONTROL_PLANE, DATA_PLANE, Event, EventLoop
from sim.plan import static_splits, with_policy
from sim.result import SimResult, SimStep, Transition, WeightSync
from sim.simulator import SimulationStalled, Simulator, simulate_spec
from sim.spec import SimSpec, resolve_steps, spec_from_config


def simulate(
    cfg: TidalConfig,
    *,
    seed: int = 0,
    steps: int | None = None,
    policy: DynamicSchedulePolicyBase | None = None,
    trace: bool = False,
) -> SimResult:
    """Simulate ``cfg`` (its configured policy unless ``policy`` is given) for ``steps`` steps."""
    name = cfg.async_training.dynamic_schedule_policy if policy is None else type(policy).__name__
    return simulate_spec(
        spec_from_config(cfg, steps),
        policy if policy is not None else policy_from_config(cfg),
        seed=seed,
        policy_name=name,
        trace=trace,
    )


__all__ = [
    "CONTROL_PLANE",
    "DATA_PLANE",
    "Event",
    "EventLoop",
    "SimResult",
    "SimSpec",
    "SimulationStalled",
    "Simulator",
    "SimStep",
    "resolve_steps",
    "simulate",
    "simulate_spec",
    "spec_from_config",
    "Transition",
    "WeightSync",
    "static_splits",
    "with_policy",
]
