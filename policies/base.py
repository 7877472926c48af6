"""The policy API: the context a policy sees and the hooks it answers, in a numbered order.

Owns: ``DynamicScheduleContext`` and ``DynamicSchedulePolicyBase`` (hook order in its docstring).
Must not: hold a policy's logic, or let a policy touch Ray, torch, the clock (time is ``ctx.now``),
logging or I/O; reasons come from ``explain`` (pure too) and the controller records them.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DynamicScheduleContext:
    """Everything a policy may look at; built fresh by the controller before each hook.

    Only the two static fields are required, so tests can write
    ``DynamicScheduleContext(required_samples=16, trigger_parameter_sync_step=4)`` and vary the
    rest with ``dataclasses.replace``.
    """

    required_samples: int
    """Samples per micro-step: ppo_mini_batch_size × require_batches (static)."""
    trigger_parameter_sync_step: int
    """Micro-steps per weight sync (static)."""
    total_generated_samples: int = 0
    """Samples finished by the rollouter since the run began."""
    expected_samples: int = 0
    """Samples the trainer has consumed up to and including this step;
    ``total_generated_samples − expected_samples`` is the backlog (surplus)."""
    buffer_samples: int = 0
    """Staleness headroom: step_required_samples × staleness_threshold."""
    step_wait_times: list[float] = field(default_factory=list)
    """Per micro-step of the latest step: seconds the trainer waited for samples."""
    step_wait_samples: list[int] = field(default_factory=list)
    """Per micro-step: samples that really had to be waited for,
    max(0, required − queue size when the micro-step started pulling)."""
    only_hybrid: bool = False
    """No standalone replicas (rollout.nnodes == 0)."""
    last_activate_duration_s: float = 0.0
    """Last hybrid weight sync + activation, seconds."""
    last_deactivate_duration_s: float = 0.0
    """Last deactivation (remove, abort, sleep), seconds."""
    now: float = 0.0
    """Controller clock, seconds (monotonic in production, virtual in the simulator)."""
    last_switch_at: float | None = None
    """``now`` of the last activation or deactivation; None before the first."""
    mq_size: int = 0
    """Samples in the message queue when the context was built."""
    standalone_replicas: int = 0
    """Standalone replicas in the load balancer."""
    hybrid_replicas: int = 0
    """Hybrid replicas the trainer can lend (active or not)."""
    standalone_lost: bool = False
    """Every standalone replica of a run that had some has died: only the hybrids can generate."""
    lent_replicas: int = 0
    """Hybrid replicas lent to rollout now (k of ``hybrid_replicas``; 0 when none)."""
    max_required_samples: int = 0
    """The staleness cap: samples started per param version (and the queue's capacity); 0 = unknown."""
    in_flight_samples: int = 0
    """Samples being generated when the context was built."""
    samples_to_start: int | None = None
    """Samples the rollouter may still start: the run's prompt budget less those started (generated
    or in flight); None when the run has no budget. Near the end of the data it, not the staleness
    cap, bounds what lent replicas can add."""
    step_required_samples: int = field(init=False)
    """Derived: required_samples × trigger_parameter_sync_step (one cycle's samples)."""

    def __post_init__(self) -> None:
        self.step_required_samples = self.required_samples * self.trigger_parameter_sync_step

    @property
    def surplus(self) -> int:
        """Backlog: generated but not yet consumed by the trainer."""
        return self.total_generated_samples - self.expected_samples


class DynamicSchedulePolicyBase(ABC):
    """Base class of every scheduling policy.

    Hook order within one Tidal step (the controller calls them; a policy never calls anything):

    1. ``should_deactivate(global_steps, is_hybrid_active, ctx)`` — before training: take the
       hybrid replicas back this step?
    2. ``deactivate_wait_samples(ctx)`` — only when (1) said yes: how many samples must be buffered
       before they are taken back.
    3. ``should_activate_after_step(global_steps, is_hybrid_active, ctx)`` — after the broadcast
       weight sync: lend the trainer's GPUs again (this also decides whether the hybrid weight sync
       happens at all)?
    4. ``request_rebalance(global_steps, ctx)`` — only after an activation: truthy asks the
       controller to re-spread in-flight requests.
    5. ``update_after_step(global_steps, ctx)`` — last: adapt internal state. Everything it changes
       must be in ``state_dict()``.

    Subclasses implement the three abstract hooks. Adaptive policies override
    ``update_after_step`` and make sure ``state_dict``/``load_state_dict`` cover what it changes;
    the default implementations snapshot every public and private attribute, which is right for
    plain-data policies.
    """

    @abstractmethod
    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        """(1) Take the hybrid replicas back before this step's training?"""

    @abstractmethod
    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        """(2) Samples that must be buffered before the hybrids are taken back."""

    @abstractmethod
    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> bool:
        """(3) Lend the trainer's GPUs to rollout after this step's weight sync?"""

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool | None:
        """(4) After an activation: truthy asks the controller to rebalance. Default: no (None)."""
        return None

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:  # noqa: B027
        """(5) Adapt internal state after the step. Default: nothing to adapt."""

    def explain(self, hook: str, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> str:
        """One-line reason for the answer ``hook`` would give now (pure; recorded by the controller)."""
        return ""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable snapshot of everything ``update_after_step`` may change."""
        return copy.deepcopy(dict(vars(self)))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a snapshot from ``state_dict`` exactly."""
        unknown = set(state) - set(vars(self))
        if unknown:
            raise KeyError(f"{type(self).__name__}.load_state_dict: unknown keys {sorted(unknown)}")
        for key, value in copy.deepcopy(state).items():
            setattr(self, key, value)
