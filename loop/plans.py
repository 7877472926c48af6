"""The frozen plans and reports a step's phases hand each other (the typed API of a step)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeactivatePlan:
    """The answer of a step's first question: take the hybrids back before training?

    ``wait_samples`` is how many samples must be queued before they are taken back (0 when
    ``deactivate`` is False). ``hybrid_active`` is the controller state when the plan was made.
    """

    step: int
    deactivate: bool = False
    wait_samples: int = 0
    hybrid_active: bool = False


@dataclass(frozen=True)
class SwitchReport:
    """One completed switch (``deactivate``, ``hybrid_sync``, ``activate``, ``rebalance``).

    ``phases`` maps each phase of the switch to its seconds, in the order they ran; ``aborted``
    counts the requests the switch aborted; ``replicas`` the hybrid replicas it moved.
    """

    kind: str
    started_at: float
    duration_s: float
    phases: dict[str, float] = field(default_factory=dict)
    aborted: int = 0
    replicas: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()
    """The operations the executor ran, in order (``loop.switches``: each one's name)."""


@dataclass(frozen=True)
class WaitReport:
    """The wait-for-samples phase: how long the hybrids kept generating, then the deactivation."""

    waited_s: float
    mq_size: int
    exhausted: bool = False
    deactivate: SwitchReport | None = None


@dataclass(frozen=True)
class RolloutCounters:
    """The numbers of the rollout service a policy context needs, read together.

    ``generated_total``: samples finished by this process's rollouter; ``queue_size``: samples
    queued for the trainer now; ``in_flight``: samples being generated now.
    """

    generated_total: int = 0
    queue_size: int = 0
    in_flight: int = 0


@dataclass(frozen=True)
class LendPlan:
    """The answer after the broadcast: lend ``count`` of the ``of`` hybrid replicas (0 = none)."""

    step: int
    count: int = 0
    of: int = 0

    @property
    def lends(self) -> bool:
        return self.count > 0


@dataclass(frozen=True)
class RunSizes:
    """The static sizes of a run the policy context needs, known when the controller is built.

    ``consumed_before`` and ``generated_before`` count what earlier processes of the run trained on
    and generated (a resume); the controller adds each step's samples to the consumed count.
    """

    required_samples: int
    trigger_parameter_sync_step: int
    buffer_samples: int = 0
    only_hybrid: bool = False
    standalone_replicas: int = 0
    hybrid_replicas: int = 0
    consumed_before: int = 0
    generated_before: int = 0
    max_required_samples: int = 0
    """The staleness cap: samples started per param version, and the queue's capacity."""
    sample_budget: int | None = None
    """Samples the run starts in all (its prompt budget, earlier processes included); None: no budget."""


@dataclass(frozen=True)
class MicroSummary:
    """What the policy context needs of one micro-step: samples trained, seconds and samples waited."""

    samples: int
    wait_s: float = 0.0
    wait_samples: int = 0


@dataclass(frozen=True)
class BroadcastReport:
    """The trainer → standalone weight sync at ``version``, and the rollouter's window metrics;
    ``hybrid``: the hybrid sync that ran during it (``dynamic_schedule_overlap_hybrid_sync``)."""

    version: int
    broadcast_s: float
    max_replica_load_s: float = 0.0
    replicas: int = 0
    window: dict[str, float] = field(default_factory=dict)
    hybrid: SwitchReport | None = None
    transport: str = "object_store"
    """How the weights went to the standalones (``collective`` or ``object_store``)."""
    sent_bytes: int = 0
    """Bytes the collective sent (once, whatever the number of replicas); 0 through the object store."""
    retries: int = 0
    """Syncs re-run without a member lost on the way."""


@dataclass(frozen=True)
class StepOutcome:
    """The end of a step: what the store keeps of the policy, the controller and the switches.

    ``decisions`` and ``switch_events`` are the step's records (drained: each is reported once).
    """

    step: int
    hybrid_active: bool
    policy_state: dict[str, Any]
    controller_state: dict[str, Any]
    decisions: tuple[Any, ...] = ()
    switch_events: tuple[SwitchReport, ...] = ()
    replacements: dict[str, Any] = field(default_factory=dict)
