"""The switches, written once: each a generator of primitive operations on the replicas.

Owns the vocabulary of operations a switch is made of (route and unroute, hold and unhold,
abort, drain, sleep, wake, load, offload and reload, resume), the order of each switch, and the
state machine of the hybrid replicas (``SwitchMachine``: asleep or lent, which are lent and synced,
at which version, the switch book). Production executes the operations as typed calls on its
load balancer and replica pool (``loop.controller``); the twin executes the very same generators
as delays from a per-operation cost table (``sim.simulator``). So a switch cannot differ between
the two but in how each operation is carried out, and the parity test compares the operations
each side actually ran.

Must not: call anything, keep a clock or know what an operation costs. A generator sends each
operation out and gets its result back (``Abort``: requests aborted; ``Drain``: requests still in
flight when it gave up; ``Offload`` / ``Reload``: the trainer's moves, seconds and GB by name);
the executor times the operations (``PhaseLog``) and hands the report to ``SwitchMachine.book``.

Switches (the operations in order; the phase each is timed under in brackets):

1. ``take_back``:   Unroute [remove] -> Abort [abort] -> Sleep [sleep] -> Reload [reload]
2. ``hybrid_sync``: Offload [offload] -> Wake [wake_up] -> Load [load_weights]
3. ``activate``:    Route [add] -> Resume [resume]
4. ``rebalance``:   ClearSticky [clear_sticky] -> Hold -> Abort [abort] -> Drain [drain] ->
   Resume [resume] -> Unhold; routing is held from before the abort until the replicas resume
   (the retries wait in the balancer, then spread least-loaded), and a failed or timed-out drain
   resumes and unholds before the error leaves.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from loop.decisions import SwitchBook
from loop.plans import SwitchReport

__all__ = [
    "Abort", "ClearSticky", "ControllerState", "Drain", "Hold", "IllegalTransition", "Load", "Offload", "Operation",
    "NOT_HERE", "PhaseLog", "Reload", "Resume", "Route", "Sleep", "Switch", "SwitchMachine", "Unhold", "Unroute", "Wake",
    "run_switch",
]


# ------------------------------------------------------------------ operations


@dataclass(frozen=True)
class _Op:
    """An operation on a set of replicas; ``phase`` names it in a switch's timed phases (None:
    untimed, as hold and unhold are) and in the parity test's record."""

    phase: ClassVar[str | None]
    ids: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.phase or type(self).__name__.lower()


@dataclass(frozen=True)
class Route(_Op):
    """Start routing new requests to ``ids``."""

    phase: ClassVar[str | None] = "add"


@dataclass(frozen=True)
class Unroute(_Op):
    """Stop routing new requests and retries to ``ids``."""

    phase: ClassVar[str | None] = "remove"


@dataclass(frozen=True)
class ClearSticky(_Op):
    """Forget every sticky session, so retries spread least-loaded."""

    phase: ClassVar[str | None] = "clear_sticky"


@dataclass(frozen=True)
class Hold(_Op):
    """Route nothing (new requests and retries wait in the balancer) until ``Unhold``."""

    phase: ClassVar[str | None] = None


@dataclass(frozen=True)
class Unhold(_Op):
    """Route again."""

    phase: ClassVar[str | None] = None


@dataclass(frozen=True)
class Abort(_Op):
    """Pause ``ids`` and abort their in-flight requests (retried, as partial rollouts, on whatever
    is routable); the result is how many were aborted."""

    phase: ClassVar[str | None] = "abort"


@dataclass(frozen=True)
class Drain(_Op):
    """Wait until nothing is in flight on ``ids``, at most ``timeout_s``; the result is what was
    still in flight then (0: drained)."""

    phase: ClassVar[str | None] = "drain"
    timeout_s: float = 60.0


@dataclass(frozen=True)
class Sleep(_Op):
    """Free the KV cache and offload the engines' weights: the GPUs go back to training."""

    phase: ClassVar[str | None] = "sleep"


@dataclass(frozen=True)
class Wake(_Op):
    """Take the GPU memory back for generation."""

    phase: ClassVar[str | None] = "wake_up"


@dataclass(frozen=True)
class Load(_Op):
    """Load the trainer's weights at param ``version``."""

    phase: ClassVar[str | None] = "load_weights"
    version: int = 0


@dataclass(frozen=True)
class Offload(_Op):
    """Before ``ids`` wake: the trainer's state leaves the devices they share (its moves back)."""

    phase: ClassVar[str | None] = "offload"


@dataclass(frozen=True)
class Reload(_Op):
    """After ``ids`` sleep: the trainer's state comes back to its devices (its moves back)."""

    phase: ClassVar[str | None] = "reload"


@dataclass(frozen=True)
class Resume(_Op):
    """Let ``ids`` accept and run requests again."""

    phase: ClassVar[str | None] = "resume"


Operation = Route | Unroute | ClearSticky | Hold | Unhold | Abort | Drain | Sleep | Wake | Load | Offload | Reload | Resume
SwitchOps = Generator[Operation, Any, int]
"""A switch: sends operations, gets each one's result back, returns the requests it aborted."""


# ------------------------------------------------------------------ switches


def take_back(ids: tuple[str, ...]) -> SwitchOps:
    yield Unroute(ids)
    aborted = int((yield Abort(ids)) or 0)
    yield Sleep(ids)
    yield Reload(ids)
    return aborted


def hybrid_sync(ids: tuple[str, ...], version: int) -> SwitchOps:
    yield Offload(ids)
    yield Wake(ids)
    yield Load(ids, version)
    return 0


def activate(ids: tuple[str, ...]) -> SwitchOps:
    yield Route(ids)
    yield Resume(ids)
    return 0


def rebalance(ids: tuple[str, ...], timeout_s: float) -> SwitchOps:
    yield ClearSticky()
    yield Hold()
    left, aborted = None, 0
    try:
        aborted = int((yield Abort(ids)) or 0)
        left = int((yield Drain(ids, timeout_s)) or 0)
    finally:
        if left != 0:  # timed out, or an operation failed: never leave generation paused or held
            try:
                yield Resume(ids)
            finally:
                yield Unhold()
    if left:
        raise TimeoutError(f"rebalance: {left} requests still in flight on {len(ids)} replicas after "
                           f"{timeout_s:g}s; the replicas were resumed")
    try:
        yield Resume(ids)
    finally:
        yield Unhold()
    return aborted


# ------------------------------------------------------------------ timing

NOT_HERE = type("NotHere", (), {"__repr__": lambda self: "NOT_HERE"})()
"""What an executor answers for an operation its side has nothing to do for (a replica pool whose
hybrids share no devices with a trainer has no trainer state to ``Offload``): not recorded."""



class PhaseLog:
    """Times the operations of one switch with the executor's clock (wall or virtual)."""

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self.phases: dict[str, float] = {}
        self.ops: list[str] = []

    def ran(self, op: Operation, seconds: float, result: Any) -> None:
        """``op`` ran for ``seconds``: its phase is timed; a trainer move (``Offload``/``Reload``)
        records each of its moves after it (``<phase>:<what>``, the trainer's own seconds and GB).
        An operation answered ``NOT_HERE`` is not recorded."""
        if result is NOT_HERE:
            return
        self.ops.append(op.name)
        if op.phase is None:
            return
        self.phases[op.phase] = self.phases.get(op.phase, 0.0) + seconds
        if isinstance(op, Offload | Reload) and isinstance(result, Mapping):
            for key, value in result.items():
                self.phases[f"{op.phase}:{key.removeprefix(op.phase + '_')}"] = float(value)

    def report(self, switch: Switch, ended_at: float, aborted: int) -> SwitchReport:
        return SwitchReport(kind=switch.kind, started_at=self.started_at, duration_s=ended_at - self.started_at,
                            phases=dict(self.phases), aborted=int(aborted), replicas=switch.replicas,
                            ops=tuple(self.ops))


def run_switch(switch: Switch, execute: Callable[[Operation], Any], clock: Callable[[], float]) -> SwitchReport:
    """Carry out ``switch`` now, each operation by ``execute``, timed by ``clock``; book it in its
    machine. An operation that raises is thrown into the switch (its cleanup runs, by the same
    executor), and the error leaves with the machine's state as it was."""
    log = PhaseLog(clock())
    ops, result, error = switch.ops, None, None
    while True:
        try:
            op = ops.throw(error) if error is not None else ops.send(result)
        except StopIteration as done:
            return switch.done(log.report(switch, clock(), done.value or 0))
        error, begin = None, clock()
        try:
            result = execute(op)
        except Exception as exc:  # noqa: BLE001 - thrown into the switch, which re-raises it
            result, error = None, exc
        log.ran(op, clock() - begin, result)


# ------------------------------------------------------------------ the machine


class ControllerState(enum.Enum):
    """Where the hybrid replicas are: asleep on the trainer, or generating behind the balancer."""

    STANDALONE_ONLY = "STANDALONE_ONLY"
    HYBRID_ACTIVE = "HYBRID_ACTIVE"


class IllegalTransition(RuntimeError):
    """A switch that the current state does not allow; nothing was called."""


class Switch:
    """One switch the machine allows now: its kind, the replicas it moves, its operations (made
    once, by ``ops``; ``preview`` lists them without running anything), and what the machine
    becomes once they all ran (``done``, given the timed report)."""

    def __init__(self, kind: str, replicas: tuple[str, ...], make_ops: Callable[[], SwitchOps],
                 finish: Callable[[], None], book: SwitchBook) -> None:
        self.kind, self.replicas = kind, replicas
        self._make_ops, self._finish, self._book = make_ops, finish, book
        self._ops: SwitchOps | None = None

    @property
    def ops(self) -> SwitchOps:
        if self._ops is None:
            self._ops = self._make_ops()
        return self._ops

    def preview(self) -> tuple[Operation, ...]:
        """The operations in order, as if each succeeded and aborted nothing (for a cost)."""
        ops, out = self._make_ops(), []
        try:
            op = next(ops)
            while True:
                out.append(op)
                op = ops.send(None)
        except StopIteration:
            return tuple(out)

    def done(self, report: SwitchReport) -> SwitchReport:
        self._finish()
        return self._book.book(report)


class SwitchMachine:
    """The hybrid replicas' state machine, one copy for production and the twin.

    STANDALONE_ONLY <-> HYBRID_ACTIVE. Graded lending (k of m): ``hybrid_sync(version, k)`` wakes
    the first k hybrids, ``activate`` lends exactly those, ``take_back`` takes back exactly the lent
    ones. A second lend while some are lent is illegal (take back first, so a lend always starts
    from all asleep). Each method checks the transition (``IllegalTransition`` before anything
    runs) and returns the ``Switch`` to execute; the state moves only when it completed.
    """

    def __init__(self, hybrid_ids: Sequence[str], initial_state: ControllerState = ControllerState.STANDALONE_ONLY):
        self.hybrids = tuple(dict.fromkeys(hybrid_ids))
        self.state = ControllerState(initial_state)
        if self.state is ControllerState.HYBRID_ACTIVE and not self.hybrids:
            raise ValueError("cannot start HYBRID_ACTIVE with no hybrid replicas")
        self.book = SwitchBook()
        """The switch log, this cycle's seconds, the count, the last one's end."""
        self.synced_version: int | None = None
        """Param version the hybrids hold since their last sleep; None when not synced."""
        self.synced: tuple[str, ...] = ()
        self.lent: tuple[str, ...] = self.hybrids if self.state is ControllerState.HYBRID_ACTIVE else ()
        self.relend_count = len(self.hybrids)
        """How many a resumed run lends again (its stored lent count)."""

    @property
    def active(self) -> bool:
        return self.state is ControllerState.HYBRID_ACTIVE

    def _require_hybrids(self, verb: str) -> None:
        if not self.hybrids:
            raise IllegalTransition(f"no hybrid replicas to {verb}")

    def _switch(self, kind: str, replicas: tuple[str, ...], ops: Callable[[], SwitchOps],
                finish: Callable[[], None]) -> Switch:
        return Switch(kind, replicas, ops, finish, self.book)

    def take_back(self) -> Switch:
        """Take the lent hybrids back for training."""
        self._require_hybrids("deactivate")
        if not self.active:
            raise IllegalTransition("cannot deactivate: hybrid replicas are not active")

        def finish() -> None:
            self.state = ControllerState.STANDALONE_ONLY
            self.lent = self.synced = ()
            self.synced_version = None

        ids = self.lent
        return self._switch("deactivate", ids, lambda: take_back(ids), finish)

    def hybrid_sync(self, version: int, count: int | None = None) -> Switch:
        """Wake ``count`` sleeping hybrids (the first ones; all when None) and load ``version``."""
        self._require_hybrids("sync")
        if self.active:
            raise IllegalTransition("cannot hybrid_sync while hybrid replicas are active; deactivate first")
        count = len(self.hybrids) if count is None else int(count)
        if not 1 <= count <= len(self.hybrids):
            raise IllegalTransition(f"cannot hybrid_sync {count} of {len(self.hybrids)} hybrid replicas")
        ids = self.hybrids[:count]

        def finish() -> None:
            self.synced, self.synced_version = ids, int(version)

        return self._switch("hybrid_sync", ids, lambda: hybrid_sync(ids, int(version)), finish)

    def activate(self, version: int | None = None, count: int | None = None) -> Switch:
        """Lend the synced hybrids (with ``version``: they must hold exactly it; with ``count``:
        that many must have been synced)."""
        self._require_hybrids("activate")
        if self.active:
            raise IllegalTransition("cannot activate: hybrid replicas are already active")
        if self.synced_version is None:
            raise IllegalTransition("cannot activate: no hybrid_sync since the last deactivate")
        if version is not None and version != self.synced_version:
            raise IllegalTransition(
                f"cannot activate: hybrid replicas hold version {self.synced_version} but the "
                f"current version is {version}; call hybrid_sync({version}) first")
        if count is not None and count != len(self.synced):
            raise IllegalTransition(f"cannot lend {count} hybrids: {len(self.synced)} were synced")
        ids = self.synced

        def finish() -> None:
            self.state, self.lent = ControllerState.HYBRID_ACTIVE, ids

        return self._switch("activate", ids, lambda: activate(ids), finish)

    def rebalance(self, active_ids: tuple[str, ...], timeout_s: float) -> Switch:
        """Spread the work onto the fresh hybrids, over every replica that generates now."""
        self._require_hybrids("rebalance")
        if not self.active:
            raise IllegalTransition("cannot rebalance: hybrid replicas are not active")
        return self._switch("rebalance", active_ids, lambda: rebalance(active_ids, timeout_s), lambda: None)

    # ------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable memory; restoring it continues the run exactly."""
        return {"state": self.state.name, "synced_version": self.synced_version, **self.book.state_dict(),
                "lent": len(self.lent), "synced": len(self.synced)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (checked whole before anything changes). ``lent`` (how
        many hybrids are lent; all, in a state written before graded lending) is what a resumed run
        lends again; a STANDALONE_ONLY state keeps it only for that."""
        try:
            name = state["state"]
            synced_version = state["synced_version"]
        except KeyError as missing:
            raise ValueError(f"controller state_dict is missing {missing}") from None
        book = SwitchBook()
        book.load_state_dict(state)
        if name not in ControllerState.__members__:
            known = ", ".join(ControllerState.__members__)
            raise ValueError(f"unknown controller state {name!r}; known: {known}")
        new_state = ControllerState[name]
        if new_state is ControllerState.HYBRID_ACTIVE and not self.hybrids:
            raise ValueError("cannot restore HYBRID_ACTIVE with no hybrid replicas")
        lent = int(state.get("lent", len(self.hybrids)))
        if not 0 <= lent <= len(self.hybrids):
            raise ValueError(f"cannot restore {lent} lent of {len(self.hybrids)} hybrid replicas")
        self.state = new_state
        self.relend_count = lent if lent > 0 else len(self.hybrids)
        self.lent = self.hybrids[: max(1, lent)] if new_state is ControllerState.HYBRID_ACTIVE else ()
        synced = int(state.get("synced", len(self.hybrids))) if synced_version is not None else 0
        self.synced = self.lent or self.hybrids[:synced]
        self.synced_version = None if synced_version is None else int(synced_version)
        self.book = book
