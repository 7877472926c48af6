"""Production and the simulator run one scripted scenario and record the same step.

Production: the real step flow, its tasks and the real controller actor class
(``ControllerHost`` → ``DynamicResourceController`` → ``loop.Decider``), with recording fakes in
place of the rollout service, the trainer and the standalone replicas (the store is a real SQLite
file, so the decisions compared are the ones the commit stored). The simulator: the same
scenario in virtual time (``tests/sim/test_sim_scripted_scenario.py``).

The fakes replay what the twin observed (``Replay``): its rollout counters and clock at each
policy context, in order, and each micro-step's wait (with the pull slices it waited out before
a stranded refill). So both sides must record the same decisions, whole: hook, answer, reason,
every input and the policy's seconds; the same controller transitions; and step metrics under the
same names but for those each side has alone (``PRODUCTION_ONLY_METRICS``, ``TWIN_ONLY_METRICS``):
a name that appears on one side only fails the test until it is listed there.

The scenario stops after step 3 and resumes: production as ``flows.training_run`` resumes (a new
controller actor, ``_restore`` from the store's last committed step, ``_warm_up``), the twin with
``Simulator(resume_after=...)``. The store keeps the resumed start's records with its first step
(``committed_step``), so the twin's records are compared under that step.
"""

from __future__ import annotations

import dataclasses
import time
import types
from collections import deque
from typing import Any

import pytest
import ray
import sqlalchemy as sa

import cluster.actors.controller_actor as controller_actor
import flows.training_run as training_run
import tasks.commit
import tasks.phases as phases
from cluster.actors import CONTROLLER, ROLLOUT_SERVICE, TRAINER, ControllerHost
from cluster.builders import hybrid_ids, run_sizes, standalone_ids
from loop.plans import RolloutCounters
from flows.training_step import training_step
from loop import STRANDED_REFILL, DecisionRecord
import metrics
import sim.simulator
import tasks.summary
from metrics import (RESOURCE_UTILIZATION, ROLLOUT_RESOURCE_UTILIZATION, STEP_GENERATED_SAMPLES, STEP_S,
                     TRAIN_ALLOCATED_TIME_S, TRAIN_COMPUTE_TIME_S, TRAIN_RESOURCE_UTILIZATION, WAIT_FOR_ENOUGH_SAMPLES_S,
                     WASTE_SWITCH_S)
from sim import SimResult
from step_scenario import (DEATHS_AFTER_TAKE_BACK_OF_STEP, EXPECTED_TRANSITIONS, RESUME_AFTER_STEP, STEPS,
                           ScriptedPolicy, committed_step, config, expected_hooks, run_scenario)
from storage import create_run, make_engine, migrate, session_scope, sqlite_url
from storage.models import Decision, SwitchEvent
from storage.store import load_resume_state
from tasks.run_ref import MicroReport, RunRef


class Replay:
    """What the twin observed, for production's fakes to answer with, in the order it was observed.

    ``contexts``: (generated total, queue size, clock) of each policy context the twin built (one
    per decision, but ``deactivate_wait_samples``, which shares ``should_deactivate``'s);
    ``micro``: each micro-step's (wait seconds, samples waited for, pull slices that ended short,
    each followed by a stranded refill).
    """

    def __init__(self, twin: SimResult | None):
        self.contexts: deque[tuple[int, int, float]] = deque()
        self.micro: deque[tuple[float, int, int]] = deque()
        if twin is None:
            return
        self.contexts.extend((d.inputs["total_generated_samples"], d.inputs["mq_size"], d.inputs["now"])
                             for d in twin.decisions if d.hook != "deactivate_wait_samples")
        pulls = [(t, step, micro) for t, kind, *rest in twin.trace if kind == "train" for step, micro in [rest[:2]]]
        short = {}
        for d in twin.decisions:
            if d.hook == STRANDED_REFILL:  # the first pull of its step to end after it
                pull = min((t, step, micro) for t, step, micro in pulls if step == d.step and t >= d.inputs["now"])
                short[pull[1:]] = short.get(pull[1:], 0) + 1
        for step in twin.steps:
            for micro, (wait_s, samples) in enumerate(zip(step.micro_wait_s, step.micro_wait_samples), start=1):
                self.micro.append((wait_s, samples, short.get((step.step, micro), 0)))


CALL_S = 0.25
"""Seconds the controller's clock moves at each call of the fake actors but a counters read or a
ping (it is the twin's clock at each policy context): switches take time, so the test of the
switch seconds' rule (``loop.step_switch_seconds``) can fail."""


class FakeDataPlane:
    """The actors behind the controller: answer at once from the ``Replay``, log every call, keep
    the clock the controller reads, and kill every standalone replica at the scripted step's
    take-back (when the hybrids leave the balancer)."""

    def __init__(self, cfg: Any, replay: Replay | None = None):
        self.cfg = cfg
        self.replay = replay or Replay(None)
        self.calls: list[tuple[str, str]] = []
        self.hybrids = set(hybrid_ids(cfg))
        self.take_backs = 0
        self.standalone_dead = False
        self.generated_before = 0
        """Samples generated before the resumed process started (its rollout service counts from 0)."""
        self.pulled = 0
        self.required = cfg.required_samples
        self.now = 0.0
        self.short_slices: int | None = None  # of the micro-step being pulled
        self.pull: tuple[float, int, int] = (0.1, 0, 0)
        self.operations: list[str] = []
        self.report_death: Any = lambda replica_id: None
        """Tell the controller a standalone died (``run_production`` wires it to the actor)."""
        """The switch operations production carried out (``record_switch_operations``), in order."""

    def clock(self) -> float:
        return self.now

    def handle(self, name: str) -> Any:
        plane = self

        class Handle:
            def __getattr__(self, method: str) -> Any:
                return types.SimpleNamespace(remote=lambda *args: plane.answer(name, method, args))

        return Handle()

    def restart(self, generated_before: int) -> None:
        """The run's process stops and a new one starts: new actors (the standalones alive), whose
        rollout service counts from 0; the controller adds ``generated_before`` (``RunSizes``)."""
        self.generated_before, self.standalone_dead = generated_before, False

    def answer(self, actor: str, method: str, args: tuple) -> Any:
        self.calls.append((actor, method))
        if method not in ("counters", "ping"):
            self.now += CALL_S
        if actor.startswith("replica:"):
            return ray.exceptions.RayActorError() if self.standalone_dead else 0
        if actor == ROLLOUT_SERVICE:
            return self.service(method, args)
        return self.trainer(method, args)

    def counters(self) -> RolloutCounters:
        if not self.replay.contexts:
            return RolloutCounters(generated_total=self.pulled, queue_size=0)
        generated, queued, self.now = self.replay.contexts.popleft()
        return RolloutCounters(generated_total=generated - self.generated_before, queue_size=queued)

    def service(self, method: str, args: tuple) -> Any:
        if method == "lb_remove" and set(args[0]) <= self.hybrids:
            self.take_backs += 1
            if self.take_backs == DEATHS_AT_TAKE_BACK and not self.standalone_dead:
                self.standalone_dead = True
                for rid in standalone_ids(self.cfg):  # as the rollout service's watch reports each death
                    self.report_death(rid)
        return {
            "counters": self.counters,
            "wait_for_queue": lambda: {"waited_s": 0.0, "mq_size": args[0], "exhausted": False},
            "on_weight_sync": dict,
            "replacement_state": dict,
            "lb_clear_sticky": lambda: 0,
            "lb_wait_drained": lambda: 0,
        }.get(method, lambda: None)()

    def trainer(self, method: str, args: tuple) -> Any:
        if method == "train_micro_step":
            return self.train_micro_step()
        if method == "save_checkpoint":
            return {"path": args[0], "sha256": "0" * 64, "size_bytes": 7}
        return 0 if method != "weights" else {}

    def train_micro_step(self) -> MicroReport:
        """The twin's wait for this micro-step; first, as many pull slices that end short as the
        twin's refills before it (the train task asks for the refill after each)."""
        if self.short_slices is None:
            self.pull = self.replay.micro.popleft() if self.replay.micro else (0.1, 0, 0)
            self.short_slices = self.pull[2]
        wait_s, wait_samples, short = self.pull
        if self.short_slices:
            self.short_slices -= 1
            return MicroReport(samples=0, timed_out=True, wait_s=wait_s if self.short_slices == short - 1 else 0.0,
                               mq_size=0, queue_size_at_start=self.required - wait_samples)
        self.short_slices = None
        first, self.pulled = self.pulled, self.pulled + self.required
        return MicroReport(samples=self.required, prompts=tuple((0, i) for i in range(first, self.pulled)),
                           versions=((0, 0),) * self.required, wait_s=0.0 if short else wait_s,
                           wait_samples=wait_samples, mq_size=0, exhausted=False, compute_s=0.1, allocated_s=0.1)


DEATHS_AT_TAKE_BACK = [t for t in EXPECTED_TRANSITIONS if t[1] == "deactivate"].index(
    (DEATHS_AFTER_TAKE_BACK_OF_STEP, "deactivate")) + 1
"""Which take-back the standalones die at (the scripted step's)."""


def _get(ref: Any, timeout: float | None = None) -> Any:
    if isinstance(ref, BaseException):
        raise ref
    return ref


@pytest.fixture(params=[False, True], ids=["reference-order", "overlap-hybrid-sync"])
def overlap(request) -> bool:
    """``dynamic_schedule_overlap_hybrid_sync`` on both sides."""
    return request.param


@dataclasses.dataclass
class Recorded:
    """What production's store kept of the scenario, and the step flow's metrics."""

    decisions: list[DecisionRecord]
    transitions: list[tuple[int, str]]
    operations: list[str]
    """Every switch operation production's protocols received, in order."""
    metrics: list[dict[str, float]]
    switch_s: list[float]
    """Each switch event's seconds, in the order of ``transitions``."""

    @property
    def hooks(self) -> list[tuple]:
        return [(d.step, d.hook, d.answer, d.reason) for d in self.decisions]


def run_production(monkeypatch, tmp_path, overlap, plane_class=None, policy_class=ScriptedPolicy,
                   replay: Replay | None = None) -> Recorded:
    """The scenario through the production step flow, with ``plane_class`` (a ``FakeDataPlane``,
    answering from ``replay``) behind the controller and ``policy_class`` in it; stopped after
    ``RESUME_AFTER_STEP`` and resumed as ``flows.training_run`` resumes."""
    cfg = config()
    plane = (plane_class or FakeDataPlane)(cfg, replay)
    fake_ray = types.SimpleNamespace(get=_get, is_initialized=lambda: True, exceptions=ray.exceptions,
                                     get_actor=lambda name, namespace=None: actors[name])
    for module in (controller_actor, phases, tasks.commit, training_run):
        monkeypatch.setattr(module, "ray", fake_ray)
    # the controller's clock (it times switches and policy calls, and stamps each context) is the twin's
    monkeypatch.setattr(controller_actor, "time", types.SimpleNamespace(time=plane.clock,
                                                                         perf_counter=time.perf_counter))
    monkeypatch.setattr("tasks.artifact.publish_step", lambda *args, **kwargs: None)
    record_switch_operations(monkeypatch, plane.operations)
    actors: dict[str, Any] = {ROLLOUT_SERVICE: plane.handle(ROLLOUT_SERVICE), TRAINER: plane.handle(TRAINER)}
    actors.update({f"replica:{rid}": plane.handle(f"replica:{rid}") for rid in standalone_ids(cfg)})

    def start_controller(consumed_before: int) -> ControllerHost:
        """The controller actor of a process of the run (as ``cluster.builders.DataPlane`` builds it)."""
        host = ControllerHost(policy_class, namespace="parity", standalone_ids=standalone_ids(cfg),
                              hybrid_ids=hybrid_ids(cfg), enable_rebalance=True, only_hybrid=False,
                              sizes=run_sizes(cfg, consumed_before=consumed_before))
        actors[CONTROLLER] = types.SimpleNamespace(**{
            name: types.SimpleNamespace(remote=getattr(host, name)) for name in dir(ControllerHost)
            if not name.startswith("_")})
        return host

    host = start_controller(0)
    plane.report_death = lambda rid: actors[CONTROLLER].replica_died.remote(rid)

    url = sqlite_url(tmp_path / "store.db")
    migrate(make_engine(url))
    with session_scope(make_engine(url)) as session:
        run_id = create_run(session, uid="parity", name="parity", project="parity", policy="scripted", seed=0,
                            config={}, output_dir=str(tmp_path)).id
    run = RunRef(uid="parity", namespace="parity", storage_url=url, output_dir=str(tmp_path),
                 required_samples=cfg.required_samples,
                 trigger_parameter_sync_step=cfg.async_training.trigger_parameter_sync_step,
                 buffer_samples=cfg.buffer_samples, only_hybrid=False, standalone_replicas=cfg.standalone_replicas,
                 hybrid_replicas=cfg.hybrid_replicas, trainer_gpus=cfg.trainer_gpus,
                 standalone_gpus=cfg.standalone_gpus, policy="scripted", overlap_hybrid_sync=overlap)
    assert host.asks_warm_up() is False  # the run start asks nothing (loop.run_start)
    lent, metrics = host.hybrid_active(), []  # as the driver does (flows.training_run): the controller's word
    for step in range(1, STEPS + 1):
        if step == RESUME_AFTER_STEP + 1:  # the run stops after the last step's commit and is resumed
            with session_scope(make_engine(url)) as session:
                state = load_resume_state(session, "parity")
            plane.restart(generated_before=len(state.consumed))
            host = start_controller(len(state.consumed))
            process = types.SimpleNamespace(controller=actors[CONTROLLER], trainer=actors[TRAINER],
                                            rollout=actors[ROLLOUT_SERVICE])
            assert training_run._restore(process, cfg, state) == (step, run.consumed_before)
            training_run._warm_up(process, run, state.param_version, state.hybrid_active, prompts=[])
            lent = host.hybrid_active()
        result = training_step(run, step, final=step == STEPS, lent=lent)
        run = run.model_copy(update={"consumed_before": run.consumed_before + result["trained"]})
        lent = result["hybrid_active"]
        metrics.append(result["metrics"])

    with session_scope(make_engine(url)) as session:
        rows = session.scalars(sa.select(Decision).where(Decision.run_id == run_id).order_by(Decision.id))
        decisions = [DecisionRecord(d.step, d.hook, d.answer_json, d.reason, d.inputs_json, d.duration_s)
                     for d in rows]
        events = list(session.scalars(sa.select(SwitchEvent).where(SwitchEvent.run_id == run_id)
                                      .order_by(SwitchEvent.id)))
    return Recorded(decisions, [(e.step, e.kind) for e in events], plane.operations, metrics,
                    [e.duration_s for e in events])


OPERATION_OF = {"add_replicas": "add", "remove_replicas": "remove", "clear_sticky": "clear_sticky", "hold": "hold",
                "unhold": "unhold", "wait_drained": "drain", "abort": "abort", "sleep": "sleep", "wake_up": "wake_up",
                "load_weights": "load_weights", "offload": "offload", "reload": "reload", "resume": "resume"}
"""Each call of the controller's ``LoadBalancer`` and ``ReplicaPool`` protocols, by the name of the
operation it carries out (``loop.switches``: ``Operation.name``)."""


def record_switch_operations(monkeypatch, operations: list[str]) -> None:
    """Production's balancer and pool adapters (what the controller actor calls) log each protocol
    call they receive, as the operation it is, before making it: what production really did."""

    def recording(cls: type) -> type:
        def wrap(method: str) -> Any:
            def call(self, *args):
                operations.append(OPERATION_OF[method])
                return getattr(cls, method)(self, *args)
            return call
        return type(cls.__name__, (cls,), {m: wrap(m) for m in OPERATION_OF if hasattr(cls, m)})

    for name in ("_BalancerAdapter", "_PoolAdapter"):
        monkeypatch.setattr(controller_actor, name, recording(getattr(controller_actor, name)))


def committed(twin: SimResult) -> tuple[list[DecisionRecord], list[tuple[int, str]]]:
    """The twin's decisions and transitions under the steps whose commit stores them
    (``committed_step``)."""
    return ([dataclasses.replace(d, step=committed_step(d.step)) for d in twin.decisions],
            [(committed_step(step), kind) for step, kind in twin.transition_kinds()])


def committed_hooks(hooks: list[tuple]) -> list[tuple]:
    return [(committed_step(step), *rest) for step, *rest in hooks]


PRODUCTION_ONLY_METRICS = frozenset({
    "dynamic_resource/hybrid_active", "fully_async/max_staleness", "fully_async/param_version",
    "fully_async/trained_samples", "timing_s/param_sync", "timing_s/wait_for_samples_in_train",
    "weight_sync/object_store/gb", "weight_sync/object_store/retries", "weight_sync/object_store/seconds",
})
"""Step metrics production's step fold (``tasks.summary.step_metrics``) names and the twin's does not."""
TWIN_ONLY_METRICS = frozenset({
    ROLLOUT_RESOURCE_UTILIZATION, STEP_GENERATED_SAMPLES, "waste/aborted_requests", "waste/aborted_tokens",
    "waste/reprefilled_tokens",
})
"""Step metrics the twin names and production's fold does not: production takes these from the
rollout service's window (``rollout.rollouter.Rollouter.on_weight_sync``), which the fake leaves
empty, as it leaves the trainer's own metrics."""


def test_production_and_the_simulator_record_the_same_decisions_inputs_and_transitions(monkeypatch, tmp_path,
                                                                                       overlap):
    twin = run_scenario(overlap)
    production = run_production(monkeypatch, tmp_path, overlap, replay=Replay(twin))
    decisions, transitions = committed(twin)

    assert production.hooks == committed_hooks(expected_hooks(overlap))
    assert production.decisions == decisions  # whole records: every input, the policy's seconds
    assert twin.transition_kinds() == EXPECTED_TRANSITIONS
    assert production.transitions == transitions


def test_production_and_the_simulator_carry_out_every_switch_by_the_same_operations_in_order(monkeypatch, tmp_path,
                                                                                         overlap):
    """Inside the switches: the operations production's balancer and replica pool received, in
    order, are the ones the twin's executor ran (``SwitchReport.ops``), switch after switch, over
    the whole scenario (lends, a skipped lend, a rebalance, a resume's relend, the refills)."""
    twin = run_scenario(overlap)
    production = run_production(monkeypatch, tmp_path, overlap, replay=Replay(twin))

    per_switch = [(t.step, t.kind, t.report.ops) for t in twin.transitions]
    assert all(ops for _, _, ops in per_switch)
    assert production.operations == [op for _, _, ops in per_switch for op in ops], per_switch


def test_production_and_the_simulator_fold_each_step_by_the_same_rule_from_the_same_terms(monkeypatch, tmp_path,
                                                                                        overlap):
    """The values, not only the names: both sides fold a step with ``metrics.fold_step``, once a
    step, from the same terms: as many micro-steps, a take-back in the first one's allocation on
    the same steps, something after training in the last one's, and the step's switch seconds;
    and each side's metrics are what the rule gives for its own terms."""
    calls: dict[str, list[dict[str, Any]]] = {"production": [], "twin": []}

    def recording(side: str, module: Any) -> None:
        rule = metrics.fold_step

        def fold(per_micro, **terms):
            calls[side].append({"per_micro": list(per_micro), **terms})
            folded = rule(per_micro, **terms)
            calls[side][-1]["folded"] = dict(folded)
            return folded

        monkeypatch.setattr(module, "fold_step", fold)

    recording("production", tasks.summary)
    recording("twin", sim.simulator)
    twin = run_scenario(overlap)
    production = run_production(monkeypatch, tmp_path, overlap, replay=Replay(twin))

    twin_calls = calls["twin"][-STEPS:]  # run_scenario simulates twice: a calm run finds when the deaths land
    assert len(calls["production"]) == len(calls["twin"]) // 2 == STEPS
    for step, ours, theirs, kept, sim_step in zip(range(1, STEPS + 1), calls["production"], twin_calls,
                                                  production.metrics, twin.steps, strict=True):
        assert len(ours["compute_s"]) == len(theirs["compute_s"]), step
        assert (ours["deactivate_s"] > 0) == (theirs["deactivate_s"] > 0) == sim_step.deactivated, step
        assert ours["after_train_s"] > 0 and theirs["after_train_s"] > 0
        assert ours["switch_s"] == pytest.approx(kept[WASTE_SWITCH_S])
        for folded, stored in ((ours["folded"], kept), (theirs["folded"], sim_step.metrics)):
            assert {k: stored[k] for k in FOLDED} == {k: folded[k] for k in FOLDED}, step


FOLDED = (TRAIN_COMPUTE_TIME_S, TRAIN_ALLOCATED_TIME_S, TRAIN_RESOURCE_UTILIZATION, WAIT_FOR_ENOUGH_SAMPLES_S, STEP_S,
          RESOURCE_UTILIZATION, WASTE_SWITCH_S)
"""What ``metrics.fold_step`` computes (the rest of a step's metrics it passes through)."""


def test_production_and_the_simulator_name_the_same_step_metrics(monkeypatch, tmp_path, overlap):
    twin = run_scenario(overlap)
    production = run_production(monkeypatch, tmp_path, overlap, replay=Replay(twin))

    for ours, theirs in zip(production.metrics, twin.steps, strict=True):
        assert set(ours) - set(theirs.metrics) == PRODUCTION_ONLY_METRICS
        assert set(theirs.metrics) - set(ours) == TWIN_ONLY_METRICS
        assert set(ours) & set(theirs.metrics)  # the fold's own names: step, waits, utilizations, switch time


def test_production_and_the_simulator_count_the_same_switches_in_a_steps_switch_seconds(monkeypatch, tmp_path,
                                                                                        overlap):
    """``waste/switch_s`` (``loop.step_switch_seconds``): on both sides every switch made during
    the step, its stranded refills' included, and not the resumed start's (which the store keeps
    with step 4's switch events). Each side's own seconds: the fakes do not replay the twin's."""
    twin = run_scenario(overlap)
    production = run_production(monkeypatch, tmp_path, overlap, replay=Replay(twin))
    assert production.transitions == committed(twin)[1]

    made_in = [t.step for t in twin.transitions]  # the step each switch was made in (0: the resumed start)
    for step, ours, theirs in zip(range(1, STEPS + 1), production.metrics, twin.steps, strict=True):
        own = [i for i, made in enumerate(made_in) if made == step]
        assert ours[WASTE_SWITCH_S] == pytest.approx(sum(production.switch_s[i] for i in own))
        assert theirs.metrics[WASTE_SWITCH_S] == pytest.approx(sum(twin.transitions[i].report.duration_s for i in own))
        assert ours[WASTE_SWITCH_S] > 0 and theirs.metrics[WASTE_SWITCH_S] > 0


# ------------------------------------------------------------------ retried phases lose nothing


class LastReadFailsOnce(FakeDataPlane):
    """``update_after_step``'s last remote read (the replacer's state) fails the first time."""

    failed = False

    def service(self, method: str, args: tuple) -> Any:
        if method == "replacement_state" and not self.failed:
            LastReadFailsOnce.failed = True
            return ray.exceptions.RayActorError(error_msg="replacement_state read failed once (injected)")
        return super().service(method, args)


class SecondHookFailsOnce(ScriptedPolicy):
    """``should_deactivate``'s second hook (``deactivate_wait_samples``) raises the first time."""

    failed = False

    def deactivate_wait_samples(self, ctx):
        if not SecondHookFailsOnce.failed:
            SecondHookFailsOnce.failed = True
            raise RuntimeError("deactivate_wait_samples failed once (injected)")
        return super().deactivate_wait_samples(ctx)


@pytest.mark.parametrize("fault", ["update_after_step's last read", "should_deactivate's second hook"])
def test_a_phase_retried_after_a_failure_records_every_decision_and_switch_once(monkeypatch, tmp_path, fault):
    monkeypatch.setattr(LastReadFailsOnce, "failed", False)
    monkeypatch.setattr(SecondHookFailsOnce, "failed", False)
    replay = Replay(run_scenario(False))
    replay.contexts.clear()  # a retried question reads the counters again: the fake counts 0 queued instead
    if fault.startswith("update_after_step"):
        recorded = run_production(monkeypatch, tmp_path, False, plane_class=LastReadFailsOnce, replay=replay)
        assert LastReadFailsOnce.failed
    else:
        recorded = run_production(monkeypatch, tmp_path, False, policy_class=SecondHookFailsOnce, replay=replay)
        assert SecondHookFailsOnce.failed
    # Prefect retried the task (retries=1): nothing lost, nothing twice
    assert recorded.hooks == committed_hooks(expected_hooks(False, refill_queued=(0, 0, 0)))
    assert recorded.transitions == [(committed_step(step), kind) for step, kind in EXPECTED_TRANSITIONS]
