"""The soak: one real run of many lend / take-back cycles, standalone replicas killed along the way.

One ``tidal run tiny-cpu`` (a child process, the way ``tests/driver_support.py`` starts drivers)
on a Ray head of the soak's own: the trainer as a rank group (``trainer.n_gpus_per_node=2``, FSDP2
over gloo, each rank hosting one hybrid replica), the standalone replicas' weights by collective
(``actor_rollout_ref.rollout.weight_sync.transport=collective``), a policy that lends after every
step (``step_counting_policy:LendingStepCountingPolicy``, the tests' lending policy), so that every
step is one cycle: take back before training, hybrid sync and lend after it.
While it runs, the soak keeps the other core busy (a spinning child process pinned to it), and
SIGKILLs a standalone replica drawn (seeded) among the live ones every ~``--kill-every`` cycles; the
run replaces it (``rollout.replace_failed_replicas``). Every few seconds it reads the RSS of every
live actor process (trainer, ranks, controller, rollout service, replicas) by pid.

What it checks, from the store's records once the run ended: the run finished, every step
committed once, every prompt of the run trained exactly once (``consumed_prompts`` against the
run's prompt order, ``cluster.builders.prompts_for``); no stall (the longest time between two step
commits) past the deadline, the weight sync's ``actor_rollout_ref.rollout.weight_sync.timeout_s``
plus the controller's 30 s grace (``CollectiveSync``), and a watchdog that ends the run if no step
commits for ``SoakSpec.hang_s``; every lend and its take-back recorded (``switch_events``:
hybrid_sync and activate after step k, deactivate before step k + 1); the samples in flight at
each kill all trained; each process's RSS growth over the run within ``RSS_BOUND_MIB``.

Owns: the ``soak`` section of ``benchmarks/RESULTS.md``, ``benchmarks/results/soak.json`` and the
``soak`` key of ``benchmarks/results.json``, the plot ``benchmarks/plots/soak_rss.png``. Must not:
touch processes it did not start (the stress child, the driver's process group and its own Ray
head are ended by pid / group id), or change the run's code paths (configuration only).
``tests/faults/test_fault_soak.py`` runs a short soak through :func:`soak` in CI.

Usage:
    .venv/bin/python benchmarks/soak.py [--cycles 500] [--kill-every 50] [--seed 20261206]
        [--no-stress] [--no-write] [--work DIR] [--timeout-s S]
    .venv/bin/python benchmarks/soak.py --write-from DIR   # write the figures of a soak run with --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT), str(ROOT / "tests")]

# as tests/conftest.py: before anything imports prefect or ray
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.pop("PREFECT_API_URL", None)

from procs import wait_or_stop  # noqa: E402
from results_io import RESULTS_MD, write_json, write_section  # noqa: E402
from run_all import write_summary  # noqa: E402

PLOT = BENCH / "plots" / "soak_rss.png"
POLICY = "step_counting_policy:LendingStepCountingPolicy"
"""Lends after every step (tests/integration; ``driver_support.pythonpath`` puts it on the path)."""
LEND_KINDS = ("hybrid_sync", "activate")
"""The switches of a lend (after a step; a ``rebalance`` follows the activation); the take-back
before the next step trains is one ``deactivate``."""
SWITCH_KINDS = ("deactivate", *LEND_KINDS)
SYNC_GRACE_S = 30.0
"""What the controller waits past ``weight_sync.timeout_s`` before it declares a member lost
(``cluster/actors/controller_actor.py``, ``CollectiveSync``: ``ray.wait(..., timeout_s + 30)``)."""
RSS_BOUND_MIB = 64.0
"""Flat: no process (actor or driver) grows by more than this between the first and the last tenth
of its samples (medians of each; samples from the first 5 % of the cycles on, warm-up, to the last
cycle, before the driver writes its report)."""
RSS_BOUND_FRACTION = 0.10
"""... nor by more than this fraction of its RSS at the start (the looser of the two holds)."""


@dataclass(frozen=True)
class SoakSpec:
    """One soak. Defaults: the long one (``benchmarks/soak.py``); CI's is ``replace``d smaller."""

    cycles: int = 500
    """Lend / take-back cycles: the run has one step more (lent after each step but the last, taken
    back before each step but the first)."""
    kill_every: int = 50
    """A standalone replica is killed about every this many cycles (seeded jitter of ±20 %)."""
    seed: int = 20261206
    stress: bool = True
    """Keep the other core busy with a spinning child process."""
    sync_timeout_s: float = 30.0
    """``actor_rollout_ref.rollout.weight_sync.timeout_s``."""
    replacement_timeout_s: float = 120.0
    """``rollout.replacement_timeout_s``."""
    hang_s: float = 300.0
    """Watchdog: no step committed for this long after the first ends the run as hung."""
    startup_s: float = 900.0
    """Watchdog before the first step: start-up (Ray workers, torch imports, Prefect's temporary
    server) took 1.5-3 min at load averages of 15-35 on the 2 cores."""
    sample_s: float = 3.0
    """Seconds between two RSS samples."""
    standalone: int = 2
    """Standalone replicas (``rollout.n_gpus_per_node``): the Ray head has 4 emulated GPUs, 2 are the trainer's."""
    timeout_s: float = 4 * 3600.0
    """The whole run's limit (the driver's process group is ended after it)."""

    @property
    def deadline_s(self) -> float:
        """The longest a step may stall on a lost member: the sync's timeout and the controller's grace."""
        return self.sync_timeout_s + SYNC_GRACE_S

    def overrides(self, work: Path, ray_address: str) -> list[str]:
        """The run's ``--set`` overrides (verl-style keys)."""
        prompts = 8 * (self.cycles + 1) + 64  # 8 samples a step (ppo_mini_batch_size 8, one micro-step)
        return [
            f"storage.url={store_url(work)}", f"trainer.default_local_dir={work}/runs", f"ray.address={ray_address}",
            f"trainer.total_training_steps={self.cycles + 1}", "trainer.n_gpus_per_node=2",
            "trainer.save_freq=0", "trainer.max_actor_ckpt_to_keep=1", "trainer.logger=file",
            "lifecycle.progress=lines",
            f"async_training.dynamic_schedule_policy={POLICY}", "async_training.trigger_parameter_sync_step=1",
            "async_training.use_dynamic_resource_scheduling=true",
            f"rollout.n_gpus_per_node={self.standalone}", "rollout.replace_failed_replicas=true",
            f"rollout.max_replacements={self.cycles // max(self.kill_every, 1) + 2}",
            f"rollout.replacement_timeout_s={self.replacement_timeout_s:g}",
            "actor_rollout_ref.rollout.weight_sync.transport=collective",
            f"actor_rollout_ref.rollout.weight_sync.timeout_s={self.sync_timeout_s:g}",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.response_length=8",
            f"task.num_prompts={prompts}",
        ]


def store_url(work: Path) -> str:
    return f"sqlite:///{work}/soak.db"


# --------------------------------------------------------------------------------------------
# What runs beside the run: the stress, the sampler / killer / watchdog
# --------------------------------------------------------------------------------------------


class Stress:
    """A child process spinning on one core (the last one this process may use), started and ended by pid."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.core = max(os.sched_getaffinity(0))

    def __enter__(self) -> Stress:
        core = self.core
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Watch:
    """What the watchers saw: RSS samples ``(t, cycle, actor name, pid, rss bytes)``, the kills, the
    rollout service's last record of the replacements, a hang."""

    samples: list[tuple[float, int, str, int, int]] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)
    replacements: list[dict] = field(default_factory=list)
    hung: str | None = None
    errors: list[str] = field(default_factory=list)
    step: int = 0
    """The last committed step seen."""


def live_actors() -> dict[str, int]:
    """Named live actors of the soak's Ray head (only the run's: the head is the soak's own) and their pids."""
    from ray._private import state  # the GCS's actor table: the head runs no dashboard, so no state API

    table = state.state.actor_table(None, actor_state_name="ALIVE")
    return {a["Name"]: int(a["Pid"]) for a in table.values() if a["Name"] and a["Pid"]}


def kill_plan(spec: SoakSpec) -> list[int]:
    """The cycles after which a replica is killed: every ``kill_every`` with ±20 % seeded jitter, none
    in the last 3 cycles."""
    rng = random.Random(spec.seed)
    jitter = max(spec.kill_every // 5, 0)
    out = []
    for k in range(1, spec.cycles // max(spec.kill_every, 1) + 1):
        at = k * spec.kill_every + rng.randint(-jitter, jitter)
        if 1 <= at <= spec.cycles - 3:
            out.append(at)
    return sorted(set(out))


class _Loop(threading.Thread):
    def __init__(self, every_s: float):
        super().__init__(daemon=True)
        self.every_s = every_s
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                if self.tick() is False:
                    return
            except Exception as exc:  # noqa: BLE001 - noted; the soak goes on
                self.note(f"{type(exc).__name__}: {exc}")
            self.halt.wait(self.every_s)

    def tick(self) -> bool | None:
        raise NotImplementedError

    def note(self, error: str) -> None:
        raise NotImplementedError


class Killer(_Loop):
    """Every 0.25 s: reads the committed step count; ends the driver's group if no step committed for
    ``hang_s`` (``startup_s`` before the first); once the next planned cycle is reached and both standalone replicas are routable (the
    last kill's replacement joined), SIGKILLs one drawn (seeded) among them, one with requests in
    flight if there is one within 3 s (mid-generation)."""

    def __init__(self, spec: SoakSpec, url: str, driver: subprocess.Popen, watch: Watch):
        super().__init__(0.25)
        from storage import make_engine

        self.spec, self.driver, self.watch = spec, driver, watch
        self.engine = make_engine(url)
        self.plan = kill_plan(spec)
        self.rng = random.Random(spec.seed + 1)
        self.last_progress = time.monotonic()
        self.due_since: float | None = None
        self.rollout = None
        self.last_stats = 0.0

    def note(self, error: str) -> None:
        if self.driver.poll() is None:  # once the driver is gone, its actors are too
            self.watch.errors.append(error)

    def tick(self) -> bool | None:
        import sqlalchemy as sa

        from storage.models import Run, Step

        if self.driver.poll() is not None:
            return False
        with self.engine.connect() as conn:
            try:
                step = int(conn.execute(sa.select(sa.func.count()).select_from(Step)).scalar_one())
                uid = conn.execute(sa.select(Run.uid)).scalar_one_or_none()
            except sa.exc.OperationalError:  # no tables yet: the driver creates the store
                step, uid = 0, None
        if step != self.watch.step:
            self.watch.step, self.last_progress = step, time.monotonic()
        elif time.monotonic() - self.last_progress > (self.spec.hang_s if step else self.spec.startup_s):
            self.watch.hung = (f"no step committed for {self.spec.hang_s:g} s after step {step}" if step else
                               f"no step committed {self.spec.startup_s:g} s after the start")
            os.killpg(self.driver.pid, signal.SIGKILL)
            return False
        if uid is None or step == 0:
            return None
        due = bool(self.plan) and step >= self.plan[0]
        if due or time.monotonic() - self.last_stats > 2.0:
            self._kill_if_due(uid, step, due)
        return None

    def _kill_if_due(self, uid: str, step: int, due: bool) -> None:
        import ray

        from cluster.actors import replica_name

        if self.rollout is None:
            self.rollout = ray.get_actor("rollout", namespace=uid)
        stats = ray.get(self.rollout.stats.remote(), timeout=30)
        self.last_stats = time.monotonic()
        self.watch.replacements = stats.get("replaced_replicas", [])
        routable = sorted(stats["standalone_replicas"])
        if not due or stats["replacements_in_progress"] or len(routable) < self.spec.standalone:
            return
        self.due_since = self.due_since or time.monotonic()
        busy = [r for r in routable if ray.get(self.rollout.lb_in_flight.remote([r]), timeout=30) > 0]
        if not busy and time.monotonic() - self.due_since < 3.0:
            return
        victim = self.rng.choice(busy or routable)
        pid = live_actors()[replica_name(victim)]
        in_flight = ray.get(self.rollout.in_flight_uids.remote(), timeout=30)
        os.kill(pid, signal.SIGKILL)
        self.plan.pop(0)
        self.due_since = None
        self.watch.kills.append({"cycle": step, "replica": victim, "pid": pid, "busy": victim in busy,
                                 "wall": time.time(), "samples_in_flight": in_flight})
        print(f"soak: cycle {step}: SIGKILL {victim} (pid {pid}, {'busy' if victim in busy else 'idle'})", flush=True)


class Sampler(_Loop):
    """Every ``sample_s``: the RSS of every live actor process of the run, and of the driver."""

    def __init__(self, spec: SoakSpec, driver: subprocess.Popen, watch: Watch):
        super().__init__(spec.sample_s)
        self.driver, self.watch, self.t0 = driver, watch, time.time()

    def note(self, error: str) -> None:
        if self.driver.poll() is None:
            self.watch.errors.append(error)

    def tick(self) -> bool | None:
        import psutil

        if self.driver.poll() is not None:
            return False
        now, step = time.time() - self.t0, self.watch.step
        for name, pid in {**live_actors(), "driver": self.driver.pid}.items():
            try:
                self.watch.samples.append((now, step, name, pid, psutil.Process(pid).memory_info().rss))
            except psutil.Error:
                pass
        return None


# --------------------------------------------------------------------------------------------
# The run and what the store says about it
# --------------------------------------------------------------------------------------------


def tree() -> str:
    """The commit the working tree is at, and whether the run's code differs from it."""
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "loop", "cluster", "tasks", "flows", "storage",
                            "policies", "config"], capture_output=True, text=True).stdout.strip()
    return commit + (" with uncommitted edits of the working tree" if dirty else "")


def soak(spec: SoakSpec, work: Path) -> dict:
    """Run one soak in ``work`` (its store, Prefect home, Ray temp dir, logs); returns its figures."""
    import driver_support as ds

    from cluster.ray_cluster import LocalRayCluster

    commit = tree()  # the code the run starts from
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / "driver.log"
    t0 = time.time()
    # a Ray head of its own (as driver_support.ray_head; attached_to leaves a session's cluster and comes back)
    head = LocalRayCluster(num_cpus=2, gpus=4, memory_gb=4.0, object_store_memory_gb=0.5,
                           env={"PYTHONPATH": ds.pythonpath()})
    with ds.attached_to(head) as cluster, (Stress() if spec.stress else contextlib.nullcontext()) as stress:
        args = ["run", "tiny-cpu", *(a for o in spec.overrides(work, cluster.address) for a in ("--set", o))]
        with open(log_path, "w") as out:
            driver = ds.start(args, work, out, ds.cli_env(extra={"PREFECT_HOME": str(work / "prefect")}))
            watch = Watch()
            loops = [Killer(spec, store_url(work), driver, watch), Sampler(spec, driver, watch)]
            for loop in loops:
                loop.start()
            try:
                code = wait_or_stop(driver, spec.timeout_s)
            finally:
                for loop in loops:
                    loop.halt.set()
                    loop.join(timeout=60)
                loops[0].engine.dispose()
                ds.end_group(driver)
        stress_core = stress.core if stress else None
    wall = time.time() - t0
    (work / "samples.json").write_text(json.dumps(watch.samples))
    figures = analyse(spec, work, watch)
    figures.update(commit=commit, exit_code=code, wall_s=round(wall, 1), stress_core=stress_core, spec=asdict(spec),
                   driver_log_tail=log_path.read_text(errors="replace")[-2000:] if code else "")
    return figures


def analyse(spec: SoakSpec, work: Path, watch: Watch) -> dict:
    """The figures, from the store's records and the watcher's samples."""
    import sqlalchemy as sa

    from cluster.builders import prompts_for
    from config import load_config
    from rollout.rollouter import sample_uid
    from storage import make_engine, run_summaries, session_scope
    from storage.models import SwitchEvent
    from storage.store import consumed_prompts, read_step_metrics

    url = store_url(work)
    cfg = load_config("tiny-cpu", spec.overrides(work, "unused"))
    engine = make_engine(url)
    try:
        with session_scope(engine) as s:
            summaries = run_summaries(s)
            uid = summaries[0].uid if summaries else None
            status = summaries[0].status if summaries else None
            rows = read_step_metrics(s, uid) if uid else []
            got = consumed_prompts(s, uid) if uid else []
            switches = s.execute(sa.select(SwitchEvent.step, SwitchEvent.kind, SwitchEvent.started_at,
                                           SwitchEvent.duration_s, SwitchEvent.aborted)
                                 .order_by(SwitchEvent.started_at)).all()
    finally:
        engine.dispose()
    steps = [r["step"] for r in rows]
    # a finished run trained exactly the prompts of its budget (the run's prompt order); an unfinished
    # one cannot be judged lost-or-not here (the exactly-once check needs its end)
    want = [(e, i) for e, i, _ in prompts_for(cfg)]
    lost = len(set(want) - set(got)) if status == "finished" else None
    duplicated = len(got) - len(set(got))
    # the samples in flight at each kill (on the victim among them) were finished elsewhere and trained
    trained_uids = {sample_uid(e, i) for e, i in got}
    in_flight_untrained = sorted({u for k in watch.kills for u in k.get("samples_in_flight", ())} - trained_uids)
    # stalls: the longest time between two step commits (the run's start counts as the first)
    ends = [r["finished_at"] for r in rows]
    starts = [r["started_at"] for r in rows]
    gaps = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    if starts:
        gaps.insert(0, ends[0] - starts[0])
    max_stall = max(gaps, default=0.0)
    per_step: dict[int, list[str]] = {}
    for step, kind, *_ in switches:
        per_step.setdefault(step, []).append(kind)
    # cycle k: lent after step k (hybrid sync, activate), taken back before step k + 1 trains
    lent = [st for st in steps[:-1] if all(k in per_step.get(st, []) for k in LEND_KINDS)
            and "deactivate" in per_step.get(st + 1, [])]
    missing = sorted(set(steps[:-1]) - set(lent))
    cycles = len(lent)
    cycle_s = [sum(d for st, k, _, d, _ in switches if (st == c and k != "deactivate") or (st == c + 1 and k == "deactivate"))
               for c in lent]
    by_kind = {kind: [d for _, k, _, d, _ in switches if k == kind] for kind in sorted({k for _, k, *_ in switches})}
    last = rows[-1] if rows else {}
    rss = rss_growth(watch.samples, warm_up=max(1, spec.cycles // 20), until=spec.cycles)
    return {
        "uid": uid, "status": status, "steps": len(steps), "steps_once": steps == list(range(1, len(steps) + 1)),
        "cycles": cycles, "steps_missing_a_switch": missing[:20], "kills": len(watch.kills), "kill_log": watch.kills,
        "replaced": int(last.get("fully_async/rollouter/replaced_replicas", 0) or 0),
        "replacements": [{k: r.get(k) for k in ("failed", "replacement", "status", "version")}
                         | {"join_s": round(r["joined_at"] - r["failed_at"], 1) if r.get("joined_at") else None}
                         for r in watch.replacements],
        "failed_replicas": int(last.get("fully_async/rollouter/failed_replicas", 0) or 0),
        "samples_trained": len(got), "samples_lost": lost, "samples_duplicated": duplicated,
        "in_flight_at_kills": sum(len(k.get("samples_in_flight", ())) for k in watch.kills),
        "in_flight_untrained": in_flight_untrained[:20],
        "prompts_expected": len(want),
        "max_stall_s": round(max_stall, 2), "deadline_s": spec.deadline_s, "hung": watch.hung,
        "switch_s": {kind: _dist(ds) for kind, ds in by_kind.items()},
        "switch_s_all": _dist([d for *_, d, _ in switches]),
        "cycle_s": _dist(cycle_s),
        "step_wall_s": _dist([r["wall_s"] for r in rows]),
        "rss": rss, "rss_samples": len(watch.samples), "watch_errors": list(dict.fromkeys(watch.errors))[:10],
    }


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, max(0, round(0.99 * (len(xs) - 1))))]
    return {"n": len(xs), "p50": round(statistics.median(xs), 4), "p99": round(p99, 4), "max": round(xs[-1], 4)}


def rss_growth(samples: list[tuple[float, int, str, int, int]], warm_up: int = 1, until: int | None = None) -> dict:
    """Per process (name and pid: a replacement is a new process; ``driver``: the `tidal run`
    process) sampled from cycle ``warm_up`` to cycle ``until`` (the run's steps; after the last one
    the driver writes its report) 10 times or more, over a tenth of that span or more: RSS (MiB) at
    its start (median of its first tenth of samples) and end (median of its last tenth), the
    growth, and whether it is within the bound. ``flat``: every process's growth is."""
    samples = [s for s in samples if s[1] >= warm_up and (until is None or s[1] <= until)]
    if not samples:
        return {"actors": {}, "max_growth_mib": None, "flat": None}
    t_start, t_end = min(t for t, *_ in samples), max(t for t, *_ in samples)
    series: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for t, _, name, pid, rss in samples:
        series.setdefault((name, pid), []).append((t, rss))
    out = {}
    for (name, pid), pts in series.items():
        span = pts[-1][0] - pts[0][0]
        if len(pts) < 10 or span < 0.1 * (t_end - t_start):
            continue
        tenth = max(len(pts) // 10, 1)
        start = statistics.median(r for _, r in pts[:tenth]) / 2**20
        end = statistics.median(r for _, r in pts[-tenth:]) / 2**20
        growth = end - start
        out[f"{name} ({pid})"] = {"start_mib": round(start, 1), "end_mib": round(end, 1),
                                  "growth_mib": round(growth, 1), "peak_mib": round(max(r for _, r in pts) / 2**20, 1),
                                  "span_s": round(span), "flat": growth <= max(RSS_BOUND_MIB, RSS_BOUND_FRACTION * start)}
    return {"actors": out, "max_growth_mib": max((a["growth_mib"] for a in out.values()), default=None),
            "flat": all(a["flat"] for a in out.values()) if out else None,
            "bound": f"growth <= max({RSS_BOUND_MIB:g} MiB, {RSS_BOUND_FRACTION:.0%} of start)"}


def plot(samples: list[tuple[float, int, str, int, int]], kills: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    series: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for _, cycle, name, pid, rss in samples:
        series.setdefault((name, pid), []).append((cycle, rss))
    for (name, pid), pts in sorted(series.items()):
        ax.plot([c for c, _ in pts], [r / 2**20 for _, r in pts], lw=1, label=f"{name} ({pid})")
    for k in kills:
        ax.axvline(k["cycle"], color="red", ls=":", lw=1)
    ax.set_xlabel("cycle (committed step); red dotted: a standalone replica SIGKILLed")
    ax.set_ylabel("RSS (MiB)")
    steady = [r / 2**20 for _, cycle, _, _, r in samples if cycle >= 1]
    if steady:  # start-up (imports) from ~50 MiB would flatten the rest
        ax.set_ylim(bottom=min(steady) - 20, top=max(steady) + 20)
    ax.set_title(title)
    ax.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def ok(f: dict, rss: bool = True) -> list[str]:
    """What failed, one line each (none: the soak held); ``rss``: the RSS bound is checked too (a short
    soak is all warm-up)."""
    bad = []
    if f["exit_code"] != 0 or f["status"] != "finished":
        bad.append(f"the run did not finish (exit {f['exit_code']}, status {f['status']})")
    if f["hung"]:
        bad.append(f"hang: {f['hung']}")
    if not f["steps_once"]:
        bad.append("steps not committed once each")
    if f["samples_lost"] is None or f["samples_lost"] or f["samples_duplicated"]:
        bad.append(f"samples lost {f['samples_lost']}, duplicated {f['samples_duplicated']}")
    if f.get("in_flight_untrained"):
        bad.append(f"samples in flight at a kill never trained: {f['in_flight_untrained']}")
    if f["max_stall_s"] > f["deadline_s"]:
        bad.append(f"a stall of {f['max_stall_s']} s past the deadline {f['deadline_s']} s")
    if f["steps_missing_a_switch"]:
        bad.append(f"cycles whose lend or take-back is not recorded: {f['steps_missing_a_switch']}")
    if rss and f["rss"]["flat"] is False:
        bad.append(f"RSS not flat: {f['rss']['max_growth_mib']} MiB")
    return bad


def markdown(f: dict, command: str, date: str, commit: str) -> str:
    sw = f["switch_s"]
    spec = f["spec"]
    rows = "\n".join(f"| {kind} | {d['n']} | {d['p50']:.3f} | {d['p99']:.3f} | {d['max']:.3f} |"
                     for kind, d in sw.items() if d.get("n"))
    actors = "\n".join(f"| {name} | {a['start_mib']} | {a['end_mib']} | {a['growth_mib']:+} | {a['peak_mib']} |"
                       for name, a in sorted(f["rss"]["actors"].items()))
    failed = ok(f)
    joined = [r for r in f.get("replacements", []) if r.get("status") == "joined"]
    flat = {True: "flat", False: "NOT flat", None: "not measured: too short"}[f["rss"]["flat"]]
    return f"""## Soak: lend / take-back cycles with replica kills (`soak.py`)

Command: `{command}` ({date}, commit {commit}; 2-core VM shared with other test runs)

One `tidal run tiny-cpu` of {spec['cycles'] + 1} steps: trainer of 2 ranks (`trainer.n_gpus_per_node=2`, FSDP2
over gloo, each rank hosting a hybrid replica), {spec['standalone']} standalone replicas with weights by
collective (`actor_rollout_ref.rollout.weight_sync.transport=collective`), a policy that lends after
every step (`{POLICY}`), `rollout.replace_failed_replicas=true`;
{'the other core kept busy by a spinning process' if spec['stress'] else 'no CPU stress'}; a standalone replica
SIGKILLed (drawn, seed {spec['seed']}) about every {spec['kill_every']} cycles.

**{f['cycles']} cycles** (a lend after step k, hybrid sync and activate, and the take-back before step k + 1,
all recorded) over {f['steps']} steps;
**{f['kills']} standalone replicas killed**, each noticed ({f['failed_replicas']} failed in the last step's
metrics) and replaced ({len(joined)} replacements joined the load balancer, {_join(joined)}; {f['replaced']}
joined by the last step's weight sync); **samples lost {f['samples_lost']}, duplicated
{f['samples_duplicated']}** ({f['samples_trained']} trained, every prompt of the run once; the
{f.get('in_flight_at_kills', 'n/a')} samples in flight at the kills all trained); **max stall
{f['max_stall_s']} s** (longest time between two step commits) against the deadline {f['deadline_s']:g} s
(`actor_rollout_ref.rollout.weight_sync.timeout_s` = {spec['sync_timeout_s']:g} s + the controller's
{SYNC_GRACE_S:g} s grace; watchdog {spec['hang_s']:g} s); **RSS growth at most {f['rss']['max_growth_mib']} MiB**
({f['rss'].get('bound', '')}: {flat}). Wall {f['wall_s'] / 60:.0f} min.

Deadlines the run relies on, each a config key: a standalone replica lost in a collective sync is
declared lost after `actor_rollout_ref.rollout.weight_sync.timeout_s` (+ the controller's grace)
and the rest sync without it; a replacement that is not routable within
`rollout.replacement_timeout_s` ({spec['replacement_timeout_s']:g} s here) is killed and counts as spent. Not config
keys: a phase waiting for samples gives up after `RunRef.wait_timeout_s` (600 s, `tasks/run_ref.py`)
and a rebalance's drain after the controller's `rebalance_timeout_s` (60 s, `loop/controller.py`).
{('**Failed:** ' + '; '.join(failed)) if failed else 'Every check held.'}

Per-switch seconds (from the store's `switch_events`):

| switch | n | median | p99 | max |
|---|---:|---:|---:|---:|
{rows}

A whole cycle's switches (take-back + hybrid sync + lend) per step: median {f['cycle_s'].get('p50')} s,
p99 {f['cycle_s'].get('p99')} s, max {f['cycle_s'].get('max')} s; a step's wall: median
{f['step_wall_s'].get('p50')} s, max {f['step_wall_s'].get('max')} s.

RSS of the processes alive over the run, the `tidal run` driver and the actors (MiB; after the
first {max(1, spec['cycles'] // 20)} cycles' warm-up: start = median of the first tenth of the samples, end = median of
the last tenth; plot: `benchmarks/plots/soak_rss.png`):

| actor (pid) | start | end | growth | peak |
|---|---:|---:|---:|---:|
{actors}

The driver (`tidal run`, not an actor: the step flows run in it) still grew by
{f.get('driver_trend')} MiB per 100 cycles over the second half of the run.

![RSS of the actors over the soak](plots/soak_rss.png)
"""


def driver_trend(samples: list, cycles: int) -> float | None:
    """The driver's RSS growth (MiB) per 100 cycles over the second half of the run (medians of the
    samples of its first and last tenth): what is left of its growth once warm-up is long over."""
    def median_in(lo: float, hi: float) -> float | None:
        xs = [r for _, c, name, _, r in samples if name == "driver" and lo <= c < hi]
        return statistics.median(xs) / 2**20 if xs else None

    a, b = median_in(0.5 * cycles, 0.6 * cycles), median_in(0.9 * cycles, cycles + 1)
    return None if a is None or b is None else round((b - a) / (0.4 * cycles) * 100, 1)


def _join(joined: list[dict]) -> str:
    secs = sorted(r["join_s"] for r in joined if r.get("join_s") is not None)
    if not secs:
        return "none measured"
    return f"{statistics.median(secs):.1f} s median and {secs[-1]:.1f} s at most from the kill to routable"


def summary(f: dict, command: str, date: str, commit: str) -> dict:
    """The ``soak`` key of results.json."""
    return {"cycles": f["cycles"], "cycles_planned": f["spec"]["cycles"], "kills": f["kills"], "replaced": f["replaced"],
            "samples_lost": f["samples_lost"], "samples_duplicated": f["samples_duplicated"],
            "max_stall_s": f["max_stall_s"], "deadline_s": f["deadline_s"],
            "deadline_keys": ["actor_rollout_ref.rollout.weight_sync.timeout_s", "rollout.replacement_timeout_s"],
            "rss_max_growth_mib": f["rss"]["max_growth_mib"], "rss_flat": f["rss"]["flat"],
            "rss_bound": f["rss"].get("bound"), "driver_rss_mib_per_100_cycles_late": f.get("driver_trend"),
            "switch_p50_s": f["switch_s_all"].get("p50"), "switch_p99_s": f["switch_s_all"].get("p99"),
            "switch_max_s": f["switch_s_all"].get("max"),
            "switch_s": dict(f["switch_s"]), "cycle_s": f["cycle_s"], "trainer_ranks": 2, "transport": "collective",
            "replacements_joined": sum(r.get("status") == "joined" for r in f.get("replacements", [])),
            "stress": f["spec"]["stress"], "wall_s": f["wall_s"], "passed": not ok(f),
            "command": command, "date": date, "commit": commit}


def write(f: dict, work: Path, later: bool = False) -> None:
    """Write a finished soak's figures (``work/figures.json``, ``work/samples.json``): the section of
    RESULTS.md, the plot, ``results/soak.json`` and the ``soak`` key of results.json. ``later``: the
    soak ran with ``--no-write --work WORK`` and this is ``--write-from WORK``."""
    spec, d = f["spec"], SoakSpec()
    opts = [f"--cycles {spec['cycles']}"] + ([f"--kill-every {spec['kill_every']}"] if spec["kill_every"] != d.kill_every else [])
    opts += [f"--seed {spec['seed']}"] if spec["seed"] != d.seed else []
    opts += ["--no-stress"] if not spec["stress"] else []
    command = " ".join([".venv/bin/python benchmarks/soak.py", *opts])
    if later:
        command += f" --no-write --work {work}; .venv/bin/python benchmarks/soak.py --write-from {work}"
    f = {**f, "driver_trend": driver_trend(_samples(work), spec["cycles"]),
         "watch_errors": list(dict.fromkeys(f.get("watch_errors", [])))}
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime((work / "figures.json").stat().st_mtime))
    commit = f.get("commit") or tree()
    plot(_samples(work), f["kill_log"], PLOT, f"soak: {f['cycles']} cycles, {f['kills']} standalone replica kills")
    write_section("soak", markdown(f, command, date, commit), RESULTS_MD)
    section = summary(f, command, date, commit)
    write_json("soak", {**section, "figures": f})
    write_summary()  # the soak key of results.json, as run_all.py merges it
    print("wrote", RESULTS_MD, PLOT, "benchmarks/results/soak.json, the soak key of benchmarks/results.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = SoakSpec()
    ap.add_argument("--cycles", type=int, default=d.cycles)
    ap.add_argument("--kill-every", type=int, default=d.kill_every)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--no-stress", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=d.timeout_s)
    ap.add_argument("--work", type=Path, default=None, help="folder for the run's store, logs, Ray and Prefect (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--write-from", type=Path, default=None, metavar="WORK",
                    help="run nothing: write the figures of the soak that ran in WORK (its figures.json)")
    args = ap.parse_args(argv)
    if args.write_from:
        f = json.loads((args.write_from / "figures.json").read_text())
        write(f, args.write_from, later=True)
        return 1 if ok(f) else 0
    spec = SoakSpec(cycles=args.cycles, kill_every=args.kill_every, seed=args.seed, stress=not args.no_stress,
                    timeout_s=args.timeout_s)
    work = args.work or Path(tempfile.mkdtemp(prefix="tidal-soak-"))
    print("soak in", work, flush=True)
    f = soak(spec, work)
    (work / "figures.json").write_text(json.dumps(f, indent=2, default=str))
    failed = ok(f)
    print(json.dumps({k: v for k, v in f.items() if k not in ("kill_log", "rss")}, indent=2, default=str))
    print("rss:", json.dumps(f["rss"], indent=2))
    print("FAILED: " + "; ".join(failed) if failed else "soak held")
    if not args.no_write:
        write(f, work)
    return 1 if failed else 0


def _samples(work: Path) -> list:
    return json.loads((work / "samples.json").read_text())


if __name__ == "__main__":
    sys.exit(main())
