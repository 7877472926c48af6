"""Security properties of what Tidal starts, writes and loads.

a) Every listener binds loopback: the Prefect server of ``LocalPrefectServer``, the Ray head of
   ``LocalRayCluster`` with a connected driver and an actor, and everything a real ``tidal run``
   starts (its own local Ray cluster through ``init_ray``, the temporary Prefect server, the Ray
   workers). The listening sockets of those processes and all their children are read from the
   kernel (psutil) and none may bind 0.0.0.0, :: or a non-loopback address.
b) A store password never lands anywhere the run writes: a real ``tidal run`` (2 steps) against a
   PostgreSQL that asks for a password; the run folder, the CLI's output, ``tidal runs``, every
   table of the store, the Prefect database of a private ``PREFECT_HOME`` (flow run parameters,
   logs, markdown artifacts) and the Ray session folder are searched for it, next to checks that
   the masked forms are there (so each search looks at the right data).
c) Checkpoints load with ``weights_only=True``: a checkpoint whose pickle would run code (create
   a marker file) is refused with one clear line, by the torch backend and by ``tidal resume``
   (even when the store's checksum was changed to match), and the marker never appears.
d) A policy name is imported as code only when given as ``module:Class``: a bare module name
   that would run code on import is an unknown policy (exit 2, one line) for ``tidal config
   check``, ``tidal run`` and ``tidal simulate``; the ``module:Class`` form imports it (explicit
   opt-in, documented in docs/policies.md, "Writing a custom policy").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from contextlib import closing
from pathlib import Path

import psutil
import pytest
import sqlalchemy as sa
import torch
from pg_support import running_postgres

from cluster.backends import CheckpointError, TorchBackend, UnsafeCheckpointError
from data.problems import CharTokenizer, make_problems
from cluster.ray_cluster import new_temp_dir
from flows.prefect_server import LocalPrefectServer
from driver_support import seed_prefect_home
from models.model import TinyLMConfig

PASSWORD = "Tidal-s3cret-7f3a9e"
CLI = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main(sys.argv[1:]))"]


# ------------------------------------------------------------------------------------ helpers


def _loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip.startswith("::ffff:127.") or ip == "::1"


def _listeners(roots: list[int]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``roots`` and their children."""
    found = set()
    for pid in roots:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            try:
                name = proc.name()
                for conn in proc.net_connections(kind="inet"):
                    if conn.status == psutil.CONN_LISTEN:
                        found.add((name, conn.laddr.ip, conn.laddr.port))
            except psutil.Error:
                continue
    return found


def _not_loopback(listeners) -> list:
    return sorted(item for item in listeners if not _loopback(item[1]))


def _cli(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`tidal ARGS` in its own process group, ended whole afterwards."""
    proc = subprocess.Popen([*CLI, *args], cwd=cwd, env=env or dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.wait(), out, err)


class _Payload:
    """Pickles to a call that creates a marker file: proof that unpickling ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _poison(path: Path, marker: Path) -> str:
    """Rewrite the checkpoint at ``path`` with a code-running object inside; returns its sha256."""
    payload = torch.load(path, weights_only=True)
    payload["extra"] = {"evil": _Payload(marker)}
    torch.save(payload, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ a) listeners

RAY_PROBE = textwrap.dedent("""
    import json, sys, time
    import psutil, ray
    from cluster.ray_cluster import LocalRayCluster

    head = LocalRayCluster(num_cpus=1, gpus=1, memory_gb=2.0, object_store_memory_gb=0.3).start()
    try:
        ray.init(address=head.address, log_to_driver=False, configure_logging=False)

        @ray.remote
        class Echo:
            def ping(self):
                return "pong"

        actor = Echo.remote()
        assert ray.get(actor.ping.remote()) == "pong"
        time.sleep(2.0)  # agents finish binding
        print(json.dumps({"gcs_port": head.port, "pids": [psutil.Process().pid, head._proc.pid]}), flush=True)
        sys.stdin.readline()  # the test reads the sockets now
    finally:
        ray.shutdown()
        head.stop()
""")


@pytest.mark.slow
def test_a_local_ray_head_its_workers_and_a_driver_listen_on_loopback_only(tmp_path):
    probe = subprocess.Popen([sys.executable, "-c", RAY_PROBE], cwd=tmp_path, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        line = probe.stdout.readline()
        info = json.loads(line) if line.startswith("{") else pytest.fail(line + probe.stdout.read()[-3000:])
        seen = _listeners(info["pids"])
        probe.stdin.write("\n")
        probe.stdin.flush()
        probe.wait(timeout=60)
    finally:
        try:
            os.killpg(probe.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    names = {name for name, _, _ in seen}
    assert info["gcs_port"] in {port for _, _, port in seen}, seen  # the GCS was among what was read
    assert {"gcs_server", "raylet"} <= names, names
    assert "ray::Echo" in names, names  # the actor's worker, with its own gRPC port
    assert _not_loopback(seen) == [], f"listening beyond loopback: {_not_loopback(seen)}"


@pytest.mark.slow
def test_a_local_prefect_server_listens_on_loopback_only(tmp_path):
    with LocalPrefectServer(home=str(seed_prefect_home(tmp_path / "prefect-home"))) as server:
        seen = _listeners([server.pid])
    assert server.port in {port for _, _, port in seen}, seen
    assert _not_loopback(seen) == [], f"listening beyond loopback: {_not_loopback(seen)}"


# ------------------------------------------------------- b) a real run with a password, and c)


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    """A 2-step `tidal run` on a password-protected PostgreSQL, its own local Ray cluster (through
    ``init_ray``, kept in a known temp dir) and a private PREFECT_HOME; what it left behind."""
    tmp = tmp_path_factory.mktemp("secret-run")
    with running_postgres(password=PASSWORD) as pg:
        url = pg.server.url()
        assert PASSWORD in url
        anonymous = sa.create_engine(url.replace(f":{PASSWORD}@", "@").replace("postgresql://", "postgresql+psycopg://"),
                                     poolclass=sa.NullPool)
        with pytest.raises(sa.exc.OperationalError, match="password"):  # the server really asks for it
            anonymous.connect().close()
        anonymous.dispose()

        prefect_home, ray_tmp = seed_prefect_home(tmp / "prefect-home"), Path(new_temp_dir())
        # INFO: the run's log lines go to the Prefect database too, and are searched with the rest
        env = {**os.environ, "PREFECT_HOME": str(prefect_home), "PYTHONUNBUFFERED": "1", "PREFECT_LOGGING_LEVEL": "INFO"}
        env.pop("PREFECT_API_URL", None)
        args = ["run", "tiny-cpu", "--set", f"storage.url={url}", "--set", f"trainer.default_local_dir={tmp}/runs",
                "--set", "trainer.total_training_steps=2", "--set", "actor_rollout_ref.rollout.response_length=8",
                "--set", f"ray.temp_dir={ray_tmp}", "--set", "ray.num_cpus=2"]
        out_f, err_f = open(tmp / "run.out", "w"), open(tmp / "run.err", "w")
        proc = subprocess.Popen([*CLI, *args], cwd=tmp, env=env, stdout=out_f, stderr=err_f, start_new_session=True)
        listeners: set = set()
        try:
            deadline = time.monotonic() + 420
            while proc.poll() is None and time.monotonic() < deadline:
                listeners |= _listeners([proc.pid])
                time.sleep(0.5)
            code = proc.poll()
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            out_f.close()
            err_f.close()
        output = (tmp / "run.out").read_text() + (tmp / "run.err").read_text()
        assert code == 0, f"exit code {code} (None: still running after 420 s):\n{output[-3000:]}"
        runs = _cli(["runs", "--storage", url], tmp, env)
        assert runs.returncode == 0, runs.stderr
        (uid,) = [line.split()[0] for line in runs.stdout.splitlines() if line.startswith("tiny-cpu-")]
        report = _cli(["report", uid, "--storage", url], tmp, env)  # reads the store by --storage
        assert report.returncode == 0, report.stderr[-3000:]
        # `tidal report` prints the paths it wrote; the markdown is the first
        written = [Path(line.removeprefix("wrote ")) for line in report.stdout.splitlines() if line.startswith("wrote ")]
        assert f"# Tidal run `{uid}`" in written[0].read_text(encoding="utf-8"), report.stdout

        engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"), poolclass=sa.NullPool)
        with engine.connect() as conn:
            tables = {t: [tuple(map(str, row)) for row in conn.execute(sa.text(f'SELECT * FROM "{t}"'))]
                      for t in sa.inspect(conn).get_table_names()}
        engine.dispose()
        try:
            yield {"pg": pg, "url": url, "tmp": tmp, "env": env, "uid": uid, "output": output,
                   "runs": runs.stdout + runs.stderr + report.stdout + report.stderr,
                   "tables": tables, "prefect_home": prefect_home, "ray_tmp": ray_tmp, "listeners": listeners,
                   "run_dir": tmp / "runs" / uid}
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)


def _files_holding(root: Path, needle: bytes) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if needle in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                pass
    return hits


@pytest.mark.slow
@pytest.mark.timeout(1200)  # includes the module's one `tidal run` (secret_run)
def test_a_every_listener_of_a_tidal_run_binds_loopback(secret_run):
    seen = secret_run["listeners"]
    print("listeners of the run:", sorted(seen))
    names = {name for name, _, _ in seen}
    assert {"gcs_server", "raylet"} <= names, names  # the run's own Ray cluster was watched
    assert len(seen) >= 5, seen
    assert _not_loopback(seen) == [], f"listening beyond loopback: {_not_loopback(seen)}"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_b_the_store_password_is_nowhere_the_run_wrote(secret_run):
    needle = PASSWORD.encode()
    run_dir, masked = secret_run["run_dir"], secret_run["url"].replace(PASSWORD, "***")

    resolved = json.loads((run_dir / "config.resolved.json").read_text())
    assert resolved["storage"]["url"] == masked  # the resolved config keeps the URL, masked
    assert (run_dir / "report.md").is_file()
    assert _files_holding(run_dir, needle) == []
    assert PASSWORD not in secret_run["output"]
    assert secret_run["uid"] in secret_run["runs"] and PASSWORD not in secret_run["runs"]

    tables = secret_run["tables"]
    assert {"runs", "steps", "metrics", "policy_states", "checkpoints"} <= set(tables)
    assert masked in " ".join(" ".join(row) for row in tables["runs"])  # the run row's config: masked
    assert [t for t, rows in tables.items() if any(PASSWORD in cell for row in rows for cell in row)] == []

    prefect_db = secret_run["prefect_home"] / "prefect.db"
    assert prefect_db.is_file()
    with closing(sqlite3.connect(f"file:{prefect_db}?mode=ro", uri=True)) as db:
        parameters = [json.loads(p) for (p,) in db.execute("SELECT parameters FROM flow_run")]
        artifacts = db.execute("SELECT count(*) FROM artifact WHERE type = 'markdown'").fetchone()[0]
        logs = db.execute("SELECT count(*) FROM log").fetchone()[0]
    run_params = [p for p in parameters if "storage_url" in p]
    assert run_params and all(p["storage_url"] == "**********" for p in run_params), run_params
    assert all(masked in " ".join(p["overrides"]) for p in run_params), run_params
    step_params = [p["run"] for p in parameters if "run" in p]
    assert len(step_params) == 2 and all(r["storage_url"] == masked for r in step_params), step_params
    assert artifacts >= 3 and logs > 0  # 2 step artifacts + the report; the search below covers them
    assert _files_holding(secret_run["prefect_home"], needle) == []
    assert _files_holding(secret_run["ray_tmp"], needle) == []


@pytest.mark.parametrize(("url", "shown"), [
    (f"postgresql://tidal:{PASSWORD}@db:5432/tidal", "postgresql://tidal:***@db:5432/tidal"),
    (f"postgresql+psycopg://tidal:{PASSWORD}@db/tidal?sslmode=require", "postgresql+psycopg://tidal:***@db/tidal?sslmode=require"),
    (f"postgresql://tidal:a@b/{PASSWORD}@db/tidal", "postgresql://tidal:***@db/tidal"),  # unescaped @ and /
    ("postgresql://tidal@db/tidal", "postgresql://tidal@db/tidal"),
    ("sqlite:///runs/tidal.db", "sqlite:///runs/tidal.db"),
    (f"storage.url=postgresql://tidal:{PASSWORD}@db/tidal", "storage.url=postgresql://tidal:***@db/tidal"),  # a --set
])
def test_b_redact_url_hides_the_password_in_every_spelling(url, shown):
    from storage import redact_url

    assert redact_url(url) == shown


def test_b_a_run_ref_shows_its_store_url_masked_in_json_and_whole_to_python(tmp_path):
    import pickle

    from fastapi.encoders import jsonable_encoder  # what Prefect records a flow parameter with

    from tasks.run_ref import RunRef

    url = f"postgresql://tidal:{PASSWORD}@db/tidal"
    ref = RunRef(uid="u", namespace="u", storage_url=url, output_dir=str(tmp_path), required_samples=1,
                 trigger_parameter_sync_step=1, buffer_samples=0, only_hybrid=False, standalone_replicas=1,
                 hybrid_replicas=1, trainer_gpus=1, standalone_gpus=1, policy="default")
    assert jsonable_encoder(ref)["storage_url"] == "postgresql://tidal:***@db/tidal"
    assert PASSWORD not in ref.model_dump_json()
    assert pickle.loads(pickle.dumps(ref)).storage_url == url  # what a phase on a Ray worker gets
    assert ref.model_copy(update={"consumed_before": 3}).storage_url == url


def test_c_the_torch_backend_refuses_a_checkpoint_that_would_run_code(tmp_path):
    tok = CharTokenizer()
    backend = TorchBackend(TinyLMConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, max_seq_len=32),
                           tok, make_problems("count", 8, 0))
    info = backend.save_checkpoint(tmp_path / "checkpoints" / "step-00001.pt")
    marker = tmp_path / "code-ran"
    sha = _poison(Path(info.path), marker)
    with pytest.raises(UnsafeCheckpointError) as raised:
        backend.load_checkpoint(info.path, expected_sha256=sha)
    message = str(raised.value)
    assert isinstance(raised.value, CheckpointError) and "\n" not in message
    assert "refused to load" in message and "weights_only=True" in message and "Please" not in message, message
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_c_resume_refuses_a_checkpoint_that_would_run_code_even_with_a_matching_checksum(secret_run):
    url, uid = secret_run["url"], secret_run["uid"]
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"), poolclass=sa.NullPool)
    with engine.begin() as conn:
        step, path = conn.execute(sa.text(
            "SELECT c.step, c.path FROM checkpoints c JOIN runs r ON r.id = c.run_id WHERE r.uid = :u "
            "ORDER BY c.step DESC LIMIT 1"), {"u": uid}).one()
        marker = secret_run["tmp"] / "resume-code-ran"
        sha = _poison(Path(path), marker)  # at the path resume loads; the store's checksum made to match
        conn.execute(sa.text("UPDATE checkpoints SET sha256 = :s WHERE path = :p"), {"s": sha, "p": path})
        # as if its driver had died: a finished run is not resumed at all (it says so and loads nothing)
        conn.execute(sa.text("UPDATE runs SET status = 'interrupted' WHERE uid = :u"), {"u": uid})
    engine.dispose()

    done = _cli(["resume", uid, "--storage", url], secret_run["tmp"], secret_run["env"], timeout=300)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert lines[-1].startswith(f"tidal: error: cannot resume from step {step}: {path}: refused to load"), lines[-1]
    assert "weights_only=True" in lines[-1] and PASSWORD not in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not marker.exists()


# ---------------------------------------------------------------------------- d) policy names

MARKER_MODULE = '''
from pathlib import Path
import os

Path(os.environ["TIDAL_TEST_MARKER"]).touch()  # importing this module is running code

from policies import DynamicSchedulePolicyBase


class MarkerPolicy(DynamicSchedulePolicyBase):
    def __init__(self, deactivate_ratio=0.5, only_hybrid=False):
        self.deactivate_ratio, self.only_hybrid = deactivate_ratio, only_hybrid

    def should_deactivate(self, global_steps, is_hybrid_active, ctx):
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx):
        return 0

    def should_activate_after_step(self, global_steps, is_hybrid_active, ctx):
        return False

    def request_rebalance(self, global_steps, ctx):
        return None

    def update_after_step(self, global_steps, ctx):
        pass
'''


@pytest.fixture
def marker_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "tidal_marker_policy.py").write_text(MARKER_MODULE)
    marker = tmp_path / "imported"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "pkg"), os.environ.get("PYTHONPATH")])),
           "TIDAL_TEST_MARKER": str(marker)}
    return env, marker


@pytest.mark.parametrize("command", [
    ["config", "check", "tiny-cpu"],
    ["run", "tiny-cpu", "--set", "storage.url=sqlite:///store/tidal.db", "--set", "trainer.default_local_dir=runs"],
    ["simulate", "tiny-cpu", "--steps", "1"],
], ids=["config-check", "run", "simulate"])
def test_d_a_bare_module_name_is_an_unknown_policy_and_is_never_imported(tmp_path, marker_module, command):
    env, marker = marker_module
    done = _cli([*command, "--set", "async_training.dynamic_schedule_policy=tidal_marker_policy"], tmp_path, env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("tidal: error: "), done.stderr
    assert "unknown dynamic scheduling policy 'tidal_marker_policy'" in done.stderr
    assert "module:Class" in done.stderr  # and it says how to name code explicitly
    assert not marker.exists()
    assert not (tmp_path / "store").exists() and not (tmp_path / "runs").exists()  # nothing half-written


def test_d_the_module_colon_class_form_is_the_explicit_opt_in_to_import_code(tmp_path, marker_module):
    env, marker = marker_module
    done = _cli(["config", "check", "tiny-cpu", "--set",
                 "async_training.dynamic_schedule_policy=tidal_marker_policy:MarkerPolicy"], tmp_path, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: tiny-cpu") and marker.exists()


@pytest.mark.parametrize("sets", [
    [f"storage.url postgresql://tidal:{PASSWORD}@db/tidal"],  # no '=': not a --set at all
    [f"storage.url=postgresql://tidal:{PASSWORD}@db/tidal", "trainer.total_training_steps=[1"],  # unparsable
    [f"storage.url=mysql://tidal:{PASSWORD}@db/tidal"],  # the URL itself is refused
    [f"storage.url=mysql://tidal:a@b/{PASSWORD}@db/tidal"],  # unescaped @ and / in the password
    [f"storage.url=postgresql://tidal:{PASSWORD}@db/tidal", "trainer.total_training_steps=x"],
])
def test_b_a_config_error_never_prints_the_store_password(sets, capsys):
    from flows.cli import main

    assert main(["run", "tiny-cpu", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert PASSWORD not in err and err.count("\n") == 1, err
