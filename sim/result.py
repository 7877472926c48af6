"""What a simulated run reports: one record per step, run totals, and the fluid lower bound."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from loop import DecisionRecord, SwitchReport
from metrics import WastedWork


class Transition(NamedTuple):
    """One controller transition of a simulated run: the step it belongs to (0 = warm-up) and
    its ``SwitchReport`` (``kind`` is ``deactivate``, ``hybrid_sync``, ``activate`` or ``rebalance``)."""

    step: int
    report: SwitchReport

    @property
    def kind(self) -> str:
        return self.report.kind


@dataclass(frozen=True)
class WeightSync:
    """One kind of weight sync over a simulated run: the transport the twin charged for it
    (``sim.broadcast_transport`` / ``sim.hybrid_transport``), seconds per sync, and how many ran."""

    transport: str
    seconds_each: float
    syncs: int

    @property
    def total_s(self) -> float:
        return self.seconds_each * self.syncs


@dataclass
class SimStep:
    """One Tidal step (``trigger_parameter_sync_step`` micro-steps and a weight sync)."""

    step: int
    start_s: float
    end_s: float
    param_version: int
    """Version the standalone replicas hold after this step's sync."""
    wait_for_samples_s: float
    """Hybrid-rollout wait before deactivation (0 when the hybrids were not taken back)."""
    micro_wait_s: list[float]
    """Per micro-step: seconds the trainer waited for samples."""
    micro_wait_samples: list[int]
    """Per micro-step: max(0, required − queue size when it started pulling)."""
    train_compute_s: float
    mq_size: int
    """Queue size right after the last micro-step."""
    step_generated_samples: int
    """Samples finished during this step's param version (reset at each sync)."""
    deactivated: bool
    activated: bool
    rebalanced: bool
    hybrid_active: bool
    """Hybrid replicas lent to rollout at the end of the step."""
    deactivate_ratio: float | None
    """The policy's ratio after ``update_after_step`` (None if it has none)."""
    train_util: float
    rollout_util: float
    cluster_util: float
    waste: WastedWork
    metrics: dict[str, float] = field(default_factory=dict)
    """The cycle's aggregated metrics (``metrics.aggregate`` names)."""

    @property
    def step_time_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class SimResult:
    """A finished simulation. Times are virtual seconds."""

    policy: str
    seed: int
    wall_clock_s: float
    fluid_bound_s: float
    """(rollout GPU-seconds + train GPU-seconds of the trained samples) / total GPUs: the time
    with every GPU busy on useful work at its best speed. The wall clock is never below it."""
    rollout_gpu_s: float
    train_gpu_s: float
    total_gpus: int
    steps: list[SimStep]
    started: int
    trained_ids: list[int]
    queued_ids: list[int]
    in_flight_ids: list[int]
    switches: int
    """Activations plus deactivations."""
    waste: WastedWork
    decisions: list[DecisionRecord]
    """Every policy question, in call order, as ``loop.Decider`` recorded it (production's records)."""
    transitions: list[Transition]
    """Every controller transition, in order (with ``decisions``: the parity of a run)."""
    trace: list[tuple[Any, ...]] | None
    events_handled: int
    trained_longest: list[int] = field(default_factory=list)
    """Per trained sample (``trained_ids``' order): its longest response, in tokens."""
    trained_tokens: list[int] = field(default_factory=list)
    """Per trained sample: the tokens it was trained on (every response with its prompt)."""
    weight_sync: dict[str, WeightSync] = field(default_factory=dict)
    """``broadcast`` (trainer → standalone replicas, every step) and ``hybrid_sync`` (trainer rank →
    its hybrid replica, when lending): the transport each was charged for and what it cost."""

    def weight_sync_line(self) -> str:
        """``weight sync: broadcast collective 5 s × 468, hybrid in_rank 1.5 s × 437`` (for a summary)."""
        parts = [f"{'hybrid' if kind == 'hybrid_sync' else kind} {w.transport} {w.seconds_each:.3g} s × {w.syncs}"
                 for kind, w in self.weight_sync.items()]
        return "weight sync: " + (", ".join(parts) or "none")

    def hooks(self) -> list[tuple[int, str, Any]]:
        """``(step, hook, answer)`` of every decision, in call order."""
        return [(d.step, d.hook, d.answer) for d in self.decisions]

    def transition_kinds(self) -> list[tuple[int, str]]:
        """``(step, kind)`` of every transition, in order."""
        return [(t.step, t.kind) for t in self.transitions]

    @property
    def trained(self) -> int:
        return len(self.trained_ids)

    @property
    def samples_per_s(self) -> float:
        return self.trained / self.wall_clock_s if self.wall_clock_s > 0 else 0.0

    def mean(self, attr: str) -> float:
        """Mean of a per-step attribute (e.g. ``cluster_util``) over the steps."""
        return sum(getattr(s, attr) for s in self.steps) / len(self.steps) if self.steps else 0.0

    def to_json(self) -> dict[str, Any]:
        """JSON-ready summary with ``per_step`` rows (the CLI's ``--json`` output)."""
        return {
            "policy": self.policy,
            "seed": self.seed,
            "steps": len(self.steps),
            "wall_clock_s": self.wall_clock_s,
            "wall_clock_h": self.wall_clock_s / 3600,
            "fluid_bound_s": self.fluid_bound_s,
            "ratio_to_bound": self.wall_clock_s / self.fluid_bound_s if self.fluid_bound_s > 0 else None,
            "rollout_gpu_s": self.rollout_gpu_s,
            "train_gpu_s": self.train_gpu_s,
            "total_gpus": self.total_gpus,
            "samples_trained": self.trained,
            "samples_per_s": self.samples_per_s,
            "switches": self.switches,
            "waste": asdict(self.waste),
            "weight_sync": {kind: {**asdict(w), "total_s": w.total_s} for kind, w in self.weight_sync.items()},
            "mean_train_util": self.mean("train_util"),
            "mean_rollout_util": self.mean("rollout_util"),
            "mean_cluster_util": self.mean("cluster_util"),
            "per_step": [
                {
                    "step": s.step,
                    "step_time_s": s.step_time_s,
                    "mq_size": s.mq_size,
                    "train_util": s.train_util,
                    "rollout_util": s.rollout_util,
                    "cluster_util": s.cluster_util,
                    "hybrid_active": s.hybrid_active,
                    "deactivate_ratio": s.deactivate_ratio,
                    "wait_for_samples_s": s.wait_for_samples_s,
                    "wait_samples": sum(s.micro_wait_samples),
                    "step_generated_samples": s.step_generated_samples,
                }
                for s in self.steps
            ],
        }
