"""Production and the simulator run one scripted scenario and record the same step.

Production: the real step flow, its tasks and the real controller actor class
(``ControllerHost`` → ``DynamicResourceController`` → ``loop.Decider``), with recording fakes in
place of the rollout service, the trainer and the standalone replicas (the store is a real SQLite
file, so the decisions compared are the ones the commit stored). The simulator: the same
scenario in virtual time (``tests/sim/test_sim_scripted_scenario.py``). Both must record the same
policy hook calls and the same controller transitions, and those must be the scenario's.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import ray
import sqlalchemy as sa

import cluster.actors.controller_actor as controller_actor
import tasks.commit
import tasks.phases as phases
from cluster.actors import CONTROLLER, ROLLOUT_SERVICE, TRAINER, ControllerHost
from cluster.builders import hybrid_ids, run_sizes, standalone_ids
from cluster.types import RolloutCounters
from flows.training_step import training_step
from step_scenario import (DEATHS_AFTER_ACTIVATION_OF_STEP, EXPECTED_HOOKS, EXPECTED_TRANSITIONS, LENDS, STEPS,
                           ScriptedPolicy, config, run_scenario)
from storage import create_run, make_engine, migrate, session_scope, sqlite_url
from storage.models import Decision, SwitchEvent
from tasks.run_ref import RunRef


class FakeDataPlane:
    """The actors behind the controller: answer at once, log every call, and kill every
    standalone replica when the hybrids are added to the balancer for the scripted step."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.calls: list[tuple[str, str]] = []
        self.hybrids = set(hybrid_ids(cfg))
        self.activations = 0
        self.standalone_dead = False
        self.pulled = 0
        self.required = cfg.required_samples

    def handle(self, name: str) -> Any:
        plane = self

        class Handle:
            def __getattr__(self, method: str) -> Any:
                return types.SimpleNamespace(remote=lambda *args: plane.answer(name, method, args))

        return Handle()

    def answer(self, actor: str, method: str, args: tuple) -> Any:
        self.calls.append((actor, method))
        if actor.startswith("replica:"):
            return ray.exceptions.RayActorError() if self.standalone_dead else 0
        if actor == ROLLOUT_SERVICE:
            return self.service(method, args)
        return self.trainer(method, args)

    def service(self, method: str, args: tuple) -> Any:
        if method == "lb_add" and set(args[0]) <= self.hybrids:
            self.activations += 1
            self.standalone_dead |= self.activations == DEATHS_AT_ACTIVATION
        return {
            "counters": lambda: RolloutCounters(generated_total=self.pulled, queue_size=0),
            "wait_for_queue": lambda: {"waited_s": 0.0, "mq_size": args[0], "exhausted": False},
            "on_weight_sync": dict,
            "replacement_state": dict,
            "lb_clear_sticky": lambda: 0,
            "lb_in_flight": lambda: 0,
        }.get(method, lambda: None)()

    def trainer(self, method: str, args: tuple) -> Any:
        if method == "train_micro_step":
            first, self.pulled = self.pulled, self.pulled + self.required
            return {"samples": [(0, i, 0, 0) for i in range(first, self.pulled)], "wait_s": 0.1, "wait_samples": 0,
                    "mq_size": 0, "exhausted": False, "metrics": {}, "timing_s": {}, "compute_s": 0.1,
                    "allocated_s": 0.1}
        if method == "save_checkpoint":
            return {"path": args[0], "sha256": "0" * 64, "size_bytes": 7}
        return 0 if method != "weights" else {}


DEATHS_AT_ACTIVATION = sorted(LENDS).index(DEATHS_AFTER_ACTIVATION_OF_STEP) + 1
"""Which lend's activation the standalones die at (the scripted step's)."""


def _get(ref: Any) -> Any:
    if isinstance(ref, BaseException):
        raise ref
    return ref


@pytest.fixture(params=[False, True], ids=["reference-order", "overlap-hybrid-sync"])
def overlap(request) -> bool:
    """``dynamic_schedule_overlap_hybrid_sync`` on both sides."""
    return request.param


@pytest.fixture
def production(monkeypatch, tmp_path, overlap):
    """Run the scenario's steps through the production step flow; returns (hooks, transitions, inputs)."""
    return run_production(monkeypatch, tmp_path, overlap)


def run_production(monkeypatch, tmp_path, overlap, plane_class=None, policy_class=ScriptedPolicy):
    """The scenario through the production step flow, with ``plane_class`` (a ``FakeDataPlane``)
    behind the controller and ``policy_class`` in it: the stored (hooks, transitions, inputs), the
    inputs being each decision's ``STEP_INPUTS``."""
    cfg = config()
    plane = (plane_class or FakeDataPlane)(cfg)
    fake_ray = types.SimpleNamespace(get=_get, is_initialized=lambda: True, exceptions=ray.exceptions,
                                     get_actor=lambda name, namespace=None: actors[name])
    for module in (controller_actor, phases, tasks.commit):
        monkeypatch.setattr(module, "ray", fake_ray)
    monkeypatch.setattr("tasks.artifact.publish_step", lambda *args, **kwargs: None)
    actors: dict[str, Any] = {ROLLOUT_SERVICE: plane.handle(ROLLOUT_SERVICE), TRAINER: plane.handle(TRAINER)}
    actors.update({f"replica:{rid}": plane.handle(f"replica:{rid}") for rid in standalone_ids(cfg)})
    host = ControllerHost(policy_class, namespace="parity", standalone_ids=standalone_ids(cfg),
                          hybrid_ids=hybrid_ids(cfg), enable_rebalance=True, only_hybrid=False,
                          sizes=run_sizes(cfg))
    actors[CONTROLLER] = types.SimpleNamespace(**{
        name: types.SimpleNamespace(remote=getattr(host, name)) for name in dir(ControllerHost)
        if not name.startswith("_")})

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
    lent = host.hybrid_active()  # as the driver does (flows.training_run): the controller's word
    for step in range(1, STEPS + 1):
        result = training_step(run, step, final=step == STEPS, lent=lent)
        run = run.model_copy(update={"consumed_before": run.consumed_before + result["trained"]})
        lent = result["hybrid_active"]

    with session_scope(make_engine(url)) as session:
        decisions = session.scalars(sa.select(Decision).where(Decision.run_id == run_id).order_by(Decision.id))
        decisions = list(decisions)
        hooks = [(d.step, d.hook, d.answer_json, d.reason) for d in decisions]
        inputs = [{k: d.inputs_json.get(k) for k in STEP_INPUTS} for d in decisions]
        events = session.scalars(sa.select(SwitchEvent).where(SwitchEvent.run_id == run_id).order_by(SwitchEvent.id))
        transitions = [(e.step, e.kind) for e in events]
    return hooks, transitions, inputs


STEP_INPUTS = ("expected_samples", "buffer_samples", "is_hybrid_active", "standalone_lost")
"""The decision inputs the step's logic decides (not the clock or the generation's timing): both
sides must record the same ones for every question."""


def test_production_and_the_simulator_record_the_same_hook_calls_and_transitions(production, overlap):
    hooks, transitions, inputs = production
    simulated = run_scenario(overlap)

    assert hooks == [(d.step, d.hook, d.answer, d.reason) for d in simulated.decisions] == EXPECTED_HOOKS
    assert transitions == simulated.transition_kinds() == EXPECTED_TRANSITIONS
    twin_inputs = [{k: d.inputs.get(k) for k in STEP_INPUTS} for d in simulated.decisions]
    assert inputs == twin_inputs


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
    if fault.startswith("update_after_step"):
        hooks, transitions, _ = run_production(monkeypatch, tmp_path, False, plane_class=LastReadFailsOnce)
        assert LastReadFailsOnce.failed
    else:
        hooks, transitions, _ = run_production(monkeypatch, tmp_path, False, policy_class=SecondHookFailsOnce)
        assert SecondHookFailsOnce.failed
    assert hooks == EXPECTED_HOOKS  # Prefect retried the task (retries=1): nothing lost, nothing twice
    assert transitions == EXPECTED_TRANSITIONS
