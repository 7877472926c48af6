"""The multi-node tests alone, in a fresh process, where Ray never ran (issue 37): Ray's temp root
(``$RAY_TMPDIR``, else ``$TMPDIR``, else ``/tmp``; then ``/ray``) does not exist yet. Ray's own
``ray.cluster_utils.Cluster`` writes ``<root>/ray/ray_current_cluster`` and failed there with a
``FileNotFoundError`` on every start of ``LocalMultiNodeCluster``; in the full suite, earlier tests
had made the folder. A fresh empty ``TMPDIR`` (and ``RAY_TMPDIR``, which wins over it) reproduces a
machine where ``/tmp/ray`` does not exist, without touching the shared ``/tmp/ray``.

Only a subset of tests/integration/test_multinode.py runs here: the two tests that start the
module's ``LocalMultiNodeCluster`` fixture and stop short of a full run (one attaches a `tidal run`
to it, which exits 2 at start; one places groups in-process), ~25 s. The whole module takes ~95 s on
two cores and runs in the suite anyway; what differs where Ray never ran is the start of the
cluster and of a driver attaching to it, which the subset covers.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SUBSET = "too_small_for_the_config or cannot_be_placed_in_time"


def test_multinode_passes_alone_where_ray_never_ran():
    fresh = Path(tempfile.mkdtemp(prefix="tidal-fresh-", dir="/tmp"))  # short: Ray's socket paths
    env = {**os.environ, "TMPDIR": str(fresh), "RAY_TMPDIR": str(fresh)}
    for inherited in ("TIDAL_TEST_PREFECT_HOME", "RAY_ADDRESS", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST"):
        env.pop(inherited, None)  # nothing of this session's state: a new Prefect home, no cluster to join
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", SUBSET,
           "tests/integration/test_multinode.py"]
    try:
        assert not (fresh / "ray").exists()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=420)
        finally:
            try:  # whatever the child left in its group (it ends its own nodes; a timeout does not)
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        assert proc.returncode == 0, out[-5000:]
        assert "2 passed" in out, out[-3000:]
        assert "FileNotFoundError" not in out, out[-5000:]
        # the folder Ray wrote ray_current_cluster to was the fresh one's (and the cluster's stop removed the file)
        assert (fresh / "ray").is_dir() and not (fresh / "ray" / "ray_current_cluster").exists()
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
