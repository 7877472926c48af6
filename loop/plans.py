"""The frozen plans and reports a step's phases hand each other (the typed API of a step)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class WaitReport:
    """The wait-for-samples phase: how long the hybrids kept generating, then the deactivation."""

    waited_s: float
    mq_size: int
    exhausted: bool = False
    deactivate: SwitchReport | None = None


@dataclass(frozen=True)
class LendPlan:
    """The answer after the broadcast: lend ``count`` of the ``of`` hybrid replicas (0 = none)."""

    step: int
    count: int = 0
    of: int = 0

    @property
    def lends(self) -> bool:
        return self.count > 0
