"""Session-wide test environment: private Prefect home, Ray settings, markers; what killed drivers left is ended;
the one local Ray cluster that the fault and integration tests attach to, and the uninterrupted reference
runs they compare their interrupted runs with, each made once per session."""

from __future__ import annotations

import os
import tempfile

# Before anything imports prefect: never share (or lock) the developer's own Prefect database.
os.environ["PREFECT_HOME"] = os.environ.get("TIDAL_TEST_PREFECT_HOME") or tempfile.mkdtemp(prefix="tidal-test-prefect-")
os.environ.pop("PREFECT_API_URL", None)  # tests that want a server start their own
# A migrated Prefect database copied into each new Prefect home (driver_support.seed_prefect_home), made
# once per suite: under pytest-xdist the workers inherit the folder the controller set here.
_MADE_TEMPLATE = "TIDAL_TEST_PREFECT_TEMPLATE" not in os.environ  # this process owns it (removes it at the end)
if _MADE_TEMPLATE:
    os.environ["TIDAL_TEST_PREFECT_TEMPLATE"] = tempfile.mkdtemp(prefix="tidal-test-prefect-template-")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402  (after the environment above, before any test imports prefect)


HEAVY_FIRST = ("e2e", "faults", "integration")
"""Under pytest-xdist, the folders whose files run whole runs (minutes each) are handed out first:
the two workers end together instead of one finishing the long tail alone."""


@pytest.hookimpl(optionalhook=True)  # a venv without pytest-xdist (the vLLM one) has no such hook
def pytest_xdist_make_scheduler(config, log):
    """`make test` (``-n 2 --dist loadfile``): a file's tests on one worker, as its module fixtures
    expect, and every e2e test on one worker, which builds the session's embedded run and Prefect
    server once (tests/e2e/conftest.py), instead of once on each. (Not xdist's ``loadgroup`` with
    marks: pytest 9.2 no longer lets it put the group into the test ids, and it quietly runs the
    tests one by one anywhere.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByFileE2eTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/e2e" if path.startswith("tests/e2e/") else path

    return ByFileE2eTogether(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """On an xdist worker, the files of whole runs first, in the order collected (the scheduler
    hands files out in the workers' order: ``--no-loadscope-reorder``). Otherwise nothing changes."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    items.sort(key=lambda item: item.nodeid.split("/")[1] not in HEAVY_FIRST)  # "tests/<folder>/..."


def pytest_unconfigure(config) -> None:
    """The suite's Prefect template folder goes with the process that made it (xdist's controller,
    not its workers nor a pytest a test starts)."""
    import shutil

    if _MADE_TEMPLATE:
        shutil.rmtree(os.environ["TIDAL_TEST_PREFECT_TEMPLATE"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _end_what_drivers_left(request):
    """After a test that ran drivers under its ``tmp_path``: end what their records
    (``<run dir>/driver/*.json``) still name. A SIGKILLed driver's Prefect server leads a session
    of its own, which the SIGKILL of the driver's process group does not reach."""
    tmp = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if tmp is None:
        return
    runs = [records.parent for records in tmp.glob("**/driver") if records.is_dir()]
    if runs:
        from flows.lifecycle import end_leftovers

        for run_dir in runs:
            end_leftovers(run_dir)


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's local Ray cluster (``driver_support.ray_head_cluster``: own temp dir, ports and
    memory limits), this process attached to it, shared by tests/faults and tests/integration: one
    start and stop (~15 s) instead of one per module. Its workers import the test-only policy in
    tests/integration by ``module:Class``. Tests that need a cluster of their own (a run that
    starts its own, several nodes) start one (``driver_support.attached_to``)."""
    from driver_support import pythonpath, ray_head_cluster

    with ray_head_cluster({"PYTHONPATH": pythonpath()}) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def ray_address(ray_cluster) -> str:
    """The address of the session's Ray cluster (``ray_cluster``)."""
    return ray_cluster.address


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, ray_address):
    """``uninterrupted(steps, *extra)``: the folder of an uninterrupted `tidal run tiny-cpu` with
    ``driver_support.config_args(folder, ray_address, "straight", steps)`` and ``extra`` arguments
    (its store: ``store_url(folder, "straight")``, its outputs: ``folder / "straight"``), made once per
    session for each (steps, extra): the tests that compare a killed-and-resumed run with an
    uninterrupted one of the same config share it (the step-counting policy and the seeded data
    make its result independent of timing and of which test made it). Under pytest-xdist the
    workers share it too: the first to need it makes it, holding a file lock in the run's common
    temp folder, and the others read its folder from there (they only read it)."""
    import fcntl
    import hashlib
    from pathlib import Path

    from driver_support import config_args, run_tidal

    made: dict[tuple[str, ...], Path] = {}
    shared = tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None

    def make_for(steps: int, extra: tuple[str, ...]) -> Path:
        folder = tmp_path_factory.mktemp("uninterrupted")
        code, log = run_tidal(["run", "tiny-cpu", *config_args(folder, ray_address, "straight", steps), *extra], folder)
        assert code == 0, log[-3000:]
        return folder

    def made_by_a_worker(key: tuple[str, ...], steps: int, extra: tuple[str, ...]) -> Path:
        name = "uninterrupted-" + hashlib.sha256("\0".join(key).encode()).hexdigest()[:16]
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also after a failed run
            where = shared / f"{name}.folder"
            if not where.exists():
                where.write_text(str(make_for(steps, extra)))
            return Path(where.read_text())

    def run(steps: int, *extra: str) -> Path:
        key = (str(steps), *extra)
        if key not in made:
            made[key] = make_for(steps, extra) if shared is None else made_by_a_worker(key, steps, extra)
        return made[key]

    return run
