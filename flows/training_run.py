"""The `training_run` flow: validate → open the store → create or resume → Ray → actors → steps → report."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path
from typing import Any

import ray
from prefect import flow, get_run_logger
from pydantic import SecretStr

from cluster.actors import ControllerHost, call
from cluster.checkpoint_file import CheckpointError, checkpoint_complete
from cluster.builders import DataPlane, prompts_for
from cluster.ray_cluster import init_ray, new_temp_dir
from config import TidalConfig, to_plain, write_resolved
from flows import lifecycle
from flows.configs import load_checked  # the same validation as the CLI
from flows.errors import CheckpointRefused, StoreLost, actor_lost, disk_full, reward_failure, store_lost_message
from flows.progress import current, step_line
from flows.report import write_report
from flows.runners import on_data_plane_phase, step_flow_client, step_flow_settings, task_runner_for
from flows.step_runs import StepRuns
from flows.trackers import StepTrackers
from flows.training_step import training_step
from tasks.artifact import RunProgress
from loop import Activate, GuardedStart, HybridSync, WarmUp, run_start
from storage import (
    RunStatus,
    StoreUnavailable,
    create_run,
    drop_steps_after,
    load_resume_state,
    migrate,
    open_store,
    redact_url,
    session_scope,
    set_run_status,
)
from tasks.run_ref import RunRef


def without_secrets(cfg: TidalConfig) -> TidalConfig:
    """``cfg`` with the store URL's password hidden: what is written next to the run and stored in
    its row (a resume gets the URL from ``--storage``, never from these copies)."""
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"url": redact_url(cfg.storage.url)})})


def _open_run(cfg: TidalConfig, resume_uid: str | None, new_uid: str | None) -> tuple[str, Path, Any, bool]:
    """Create a run row (fresh, named ``new_uid`` when given) or load the last committed step
    (resume), and take the run's lease in the same transaction unless this process holds it
    already (``tidal resume`` takes it before anything starts). The last value: whether the
    lease was taken here (and so is released at the end of this flow run)."""
    engine = open_store(cfg.storage.url, busy_timeout_ms=cfg.storage.busy_timeout_ms)
    migrate(engine)
    with session_scope(engine, immediate=True) as session:
        if resume_uid is not None:
            state = _last_complete_step(session, resume_uid)
            from storage import get_run

            row = get_run(session, resume_uid)
            if row is None:
                raise ValueError(f"run {resume_uid!r} is not in the store at {redact_url(cfg.storage.url)}")
            uid, out = resume_uid, Path(row.output_dir)
        else:
            from flows.driver import new_uid as make_uid

            uid, state = new_uid or make_uid(cfg), None
            out = Path(cfg.trainer.default_local_dir) / uid
            shown = without_secrets(cfg)
            write_resolved(shown, out)
            create_run(session, uid=uid, name=cfg.trainer.experiment_name, project=cfg.trainer.project_name,
                       policy=cfg.async_training.dynamic_schedule_policy, seed=cfg.trainer.seed,
                       config=to_plain(shown), output_dir=str(out))
        took = not lifecycle.holds(uid)
        if took:
            lifecycle.take_lease(session, uid, cfg.lifecycle.lease_timeout_s)
        set_run_status(session, uid, RunStatus.RUNNING)
    if took:
        lifecycle.keep_alive(cfg, uid)
    return uid, out, state, took


def _last_complete_step(session: Any, uid: str) -> Any:
    """The resume state of the last committed step whose trainer checkpoint is complete on disk.
    A checkpoint written in the background (``actor.checkpoint.async_save``) may have been cut
    off by the stop: its step (and any after it) is dropped from the store, so its prompts are
    trained again and nothing is lost or trained twice."""
    state = load_resume_state(session, uid)
    while state is not None and state.checkpoint is not None and not checkpoint_complete(state.checkpoint.path):
        before = state.checkpoint_step - 1
        dropped = drop_steps_after(session, uid, before)
        get_run_logger().warning(f"step {state.checkpoint_step}'s checkpoint was still being written when the run "
                                 f"stopped; resuming after step {before} (dropped steps {dropped}: their prompts "
                                 f"are trained again)")
        state = load_resume_state(session, uid)
    return state


RAY_START_TRIES = 2
"""A local cluster whose start timed out is started once more: Ray gives its raylet a fixed 30 s to
register with the GCS (``ray/_private/node.py``), which a loaded 2-core machine can miss."""


def _start_ray(cfg: TidalConfig, uid: str, out_dir: Path) -> str | None:
    """Attach to ``ray.address`` or start the run's own local cluster; a cluster started here is
    recorded in the run's folder (its processes and temp dir: a resume after a SIGKILL ends them)
    and, when its start fails half-way, ended at once (and started once more when Ray's own start-up
    wait ran out: ``RAY_START_TRIES``). Ray's own processes block SIGINT, so a terminal's Ctrl-C
    reaches only the driver. Returns the temp dir of a cluster started here."""
    attempt = 1
    while True:
        before = lifecycle.children()
        owned = None if cfg.ray.address or cfg.ray.temp_dir else new_temp_dir()
        try:
            init_ray(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus,
                     gpus=cfg.trainer_gpus + cfg.standalone_gpus, memory_gb=cfg.ray.memory_gb,
                     object_store_memory_gb=cfg.ray.object_store_memory_gb, temp_dir=cfg.ray.temp_dir or owned,
                     namespace=uid, ray_gpus=0 if cfg.engines.device == "cpu" else None)
        except BaseException as exc:
            if cfg.ray.address:
                raise
            # what the failed start left running is this process's children
            lifecycle.end_record(lifecycle.Record("ray-head", tuple((pid, 0) for pid in lifecycle.children() - before),
                                                  dirs=(owned,) if owned else ()))
            if attempt == RAY_START_TRIES or not _ray_start_timed_out(exc):
                raise
            logging.getLogger("tidal").warning("run %s: Ray's local node did not start in time (%s); starting it "
                                               "once more", uid, exc)
            ray.shutdown()
            attempt += 1
            continue
        if not cfg.ray.address:
            lifecycle.write_record(out_dir, "ray-head", tuple(sorted(lifecycle.children() - before)),
                                   dirs=(owned,) if owned else ())
        return owned


def _ray_start_timed_out(exc: BaseException) -> bool:
    """Ray's own words when its raylet did not register in time (it raises a bare ``Exception``)."""
    return "timed out during startup" in str(exc)


def _kill_actors(plane: DataPlane) -> None:
    """End the run's actors at once (a stop request: no graceful drain)."""
    for handle in (plane.controller, plane.rollout, plane.trainer, *plane.ranks, *plane.standalone.values()):
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def _restore(plane: DataPlane, cfg: TidalConfig, state: Any) -> tuple[int, int]:
    """Put the actors where the last committed step left them; returns (next step, consumed)."""
    if state is None:
        return 1, 0
    if state.checkpoint is not None:
        try:
            ray.get(plane.trainer.load_checkpoint.remote(state.checkpoint.path, state.checkpoint.sha256))
        except CheckpointError as exc:  # raised in the trainer actor; Ray wraps it with its traceback
            cause = getattr(exc, "cause", None) or exc
            raise CheckpointRefused(f"cannot resume from step {state.step}: {cause}") from None
    ray.get(plane.controller.load_policy_state.remote(state.policy_state))
    controller_state = dict(state.controller_state)
    controller_state["state"] = "STANDALONE_ONLY"  # the actors are new: the hybrids start asleep
    ray.get(call(plane.controller, ControllerHost.load_controller_state, controller_state))
    return state.step + 1, len(state.consumed)


def _warm_up(plane: DataPlane, run: RunRef, version: int, was_active: bool, prompts: list) -> None:
    """Load the weights everywhere and start generating; then ``loop.run_start``: a resumed run
    whose hybrids were lent when it stopped lends them again, and an only-hybrid run lends them
    from the start (nothing else generates), each a recorded guard decision; otherwise no policy
    question unless the policy sets ``warm_up_lend`` (a recorded decision)."""
    ray.get(call(plane.controller, ControllerHost.broadcast_sync, version, False))
    ray.get(plane.rollout.start.remote(prompts))
    asks = bool(run.hybrid_replicas) and ray.get(call(plane.controller, ControllerHost.asks_warm_up))
    phases = run_start(version, has_hybrids=run.hybrid_replicas > 0, asks_warm_up=asks, relend=was_active,
                       only_hybrid=run.only_hybrid)
    result: Any = None
    while True:
        try:
            intent = phases.send(result)
        except StopIteration:
            return
        match intent:
            case GuardedStart(version=v, relend=relend):
                start = ControllerHost.relend_after_resume if relend else ControllerHost.lend_only_hybrids
                result = ray.get(call(plane.controller, start, v))
            case WarmUp(version=v):
                result = ray.get(call(plane.controller, ControllerHost.warm_up, v))
            case HybridSync(plan=plan, version=v):
                result = ray.get(call(plane.controller, ControllerHost.hybrid_sync, plan, v))
            case Activate(plan=plan):
                result = ray.get(call(plane.controller, ControllerHost.activate, plan, []))


def _mark_failed(cfg: TidalConfig, uid: str, status: RunStatus = RunStatus.FAILED, within_s: float = 5.0) -> None:
    lifecycle.record_end(cfg.storage.url, uid, status, busy_timeout_ms=cfg.storage.busy_timeout_ms,
                         within_s=within_s)


def _flow_run_name() -> str:
    """The `training-run` flow run's name in the UI: the Tidal run id when the caller gave one
    (the CLI does; ``_name_flow_run`` renames a deployment's run once its id is known)."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    return str(params.get("run_id") or params.get("resume") or f"{params.get('config', 'run')}-starting")


def _name_flow_run(uid: str) -> None:
    """Name this flow run after the Tidal run id ``uid`` (so the UI matches `tidal runs`)."""
    from prefect import get_client
    from prefect.runtime import flow_run

    if flow_run.id and flow_run.name != uid:
        with get_client(sync_client=True) as client:
            client.update_flow_run(flow_run.id, name=uid)


@flow(name="training-run", flow_run_name=_flow_run_name, log_prints=True, validate_parameters=False)
def training_run(config: str = "tiny-cpu", overrides: list[str] | None = None, resume: str | None = None,
                 storage_url: SecretStr | None = None, run_id: str | None = None) -> dict[str, Any]:
    """Train (or resume ``resume``) the config ``config`` with ``overrides``.

    ``storage_url`` replaces the config's store URL. It is a secret so that Prefect records it as
    ``**********`` among the flow run's parameters: the CLI passes the store URL here (it may carry
    a password) and the overrides with any password already hidden. ``run_id``: the id of a fresh
    run (the CLI picks it, to know the run's folder before the run starts); default a new one.
    """
    overrides = list(overrides or [])
    if storage_url is not None:  # a deployment run may pass it as a plain string (no validation)
        url = storage_url.get_secret_value() if isinstance(storage_url, SecretStr) else str(storage_url)
        overrides.append(f"storage.url={url}")
    cfg = load_checked(config, overrides)
    logger = get_run_logger()
    uid, out_dir, state, took_lease = _open_run(cfg, resume, run_id)
    progress = current(uid, cfg)
    trackers = StepTrackers.open(cfg, uid, out_dir)  # trainer.logger; starts this session's clock
    ray_temp_dir: str | None = None
    plane: DataPlane | None = None
    committed = state.step if state else 0
    interrupted = False
    try:
        _record_flow_run(out_dir)
        _name_flow_run(uid)
        progress.stage("Ray cluster")
        ray_temp_dir = _start_ray(cfg, uid, out_dir)
        consumed_set = state.consumed if state else frozenset()
        version = state.param_version if state else 0
        progress.stage("actors")
        plane = DataPlane.build(cfg, uid, consumed=consumed_set, param_version=version,
                                replacement_state=state.data_position.get("replacements") if state else None)
        progress.stage("weights")
        next_step, consumed = _restore(plane, cfg, state)
        run = RunRef.from_config(cfg, uid=uid, output_dir=str(out_dir), consumed_before=consumed,
                                 ray_address=ray.get_runtime_context().gcs_address)
        prompts = prompts_for(cfg, consumed_set)
        # steps that still have data: a step never starts only to find the data gone
        last_step = next_step - 1 + math.ceil(len(prompts) / cfg.step_required_samples)
        if cfg.trainer.total_training_steps is not None:
            last_step = min(last_step, cfg.trainer.total_training_steps)
        _warm_up(plane, run, version, bool(state and state.hybrid_active), prompts)
        lent = ray.get(call(plane.controller, ControllerHost.hybrid_active))  # step 1's: the controller's word
        step_flow = training_step.with_options(task_runner=task_runner_for(cfg, run.ray_address))
        logger.info("run %s: %s steps from step %d", uid, cfg.trainer.total_training_steps or "all", next_step)
        progress.begin(next_step, last_step)
        step = next_step
        # entered once: building Prefect's settings costs ~0.25 s a time, a client ~0.1 s
        with step_flow_settings(), step_flow_client(), RunProgress(uid, last_step) as shown, \
                StepRuns(step_flow) as step_runs, on_data_plane_phase(step_runs.release), \
                on_data_plane_phase(shown.release):
            shown.show(committed)
            while step <= last_step:
                # this step; the next one's flow run is created while this one's data plane works
                result = step_runs.run(_step_parameters(run, step, last_step, lent),
                                       then=_step_parameters(_next_ref(run, cfg), step + 1, last_step, lent))
                lent = result["hybrid_active"]  # as the controller reported it at the step's end
                committed = step
                if lost := result.get("store_lost"):  # after the step's commit (tasks.phases.commit)
                    raise StoreUnavailable(lost["message"], url=lost["url"], reason=lost["reason"])
                trackers.log(step, result["metrics"])  # the committed step, to every tracker once
                progress.step(step, result)
                logger.info(step_line(step, last_step, result, progress.eta_s()))  # the UI's log of the run
                shown.show(committed)
                consumed += result["trained"]
                run = run.model_copy(update={"consumed_before": consumed})
                if result["trained"] == 0:
                    break
                step += 1
        progress.phase("report")
        report = write_report(cfg, uid, out_dir)
        with session_scope(open_store(cfg.storage.url, busy_timeout_ms=cfg.storage.busy_timeout_ms)) as session:
            set_run_status(session, uid, RunStatus.FINISHED)
        progress.done(report)
        return {"run": uid, "steps": step, "output_dir": str(out_dir), "report": report}
    except StoreUnavailable as exc:  # the database went away mid-run: say so in one line, resumably
        _mark_failed(cfg, uid, within_s=0)  # one try (it may wait out the store's reconnect bound)
        raise StoreLost(store_lost_message(url=redact_url(cfg.storage.url), reason=exc.reason or str(exc), uid=uid,
                                           last_step=committed, storage_arg=redact_url(cfg.storage.url))) from exc
    except BaseException as exc:
        signum = lifecycle.interruption(exc)
        interrupted = signum is not None
        if interrupted:
            lifecycle.note_stop(signum)
        _mark_failed(cfg, uid, RunStatus.INTERRUPTED if interrupted else RunStatus.FAILED)
        failure = (reward_failure(exc) or disk_full(exc, uid=uid, storage_arg=redact_url(cfg.storage.url))
                   or actor_lost(exc, uid=uid, last_step=committed, storage_arg=redact_url(cfg.storage.url)))
        if failure is not None and not interrupted:  # a reward function, the disk or an actor failed: one line
            raise failure from exc
        raise
    finally:
        trackers.close()
        progress.close()
        _take_down(plane, ray_temp_dir, out_dir, fast=interrupted)
        if took_lease:
            lifecycle.let_go(uid)


def _step_parameters(run: RunRef, step: int, last_step: int, lent: bool) -> dict[str, Any] | None:
    """The ``training_step`` flow's parameters for ``step`` (None past the run's last step). For the
    next step's run made ahead, ``lent`` is this step's: a guess, corrected if the step lends or
    takes the hybrids back (``StepRuns``)."""
    return None if step > last_step else {"run": run, "step": step, "final": step == last_step, "lent": lent}


def _next_ref(run: RunRef, cfg: TidalConfig) -> RunRef:
    """The next step's ``RunRef`` as far as it is known before this step ends: a step trains a
    whole step's prompts, unless the data runs out (``StepRuns`` then corrects the recorded one)."""
    return run.model_copy(update={"consumed_before": run.consumed_before + cfg.step_required_samples})


def _record_flow_run(out_dir: Path) -> None:
    """Record this flow run's id in the run's folder: a resume after a SIGKILL marks it Crashed."""
    from prefect.runtime import flow_run

    if flow_run.id:
        lifecycle.write_record(out_dir, "flow-run", info={"id": str(flow_run.id)})


def _take_down(plane: DataPlane | None, ray_temp_dir: str | None, out_dir: Path, *, fast: bool) -> None:
    """End the run's actors (at once on a stop request, else after draining), then its Ray cluster."""
    if plane is not None:
        if fast:
            _kill_actors(plane)
        else:
            plane.shutdown()
    ray.shutdown()  # ends a cluster this process started; only disconnects from an attached one
    if ray_temp_dir:
        shutil.rmtree(ray_temp_dir, ignore_errors=True)
    lifecycle.drop_record(out_dir, "ray-head")
    lifecycle.drop_record(out_dir, "flow-run")
