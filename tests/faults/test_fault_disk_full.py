"""Fault campaign, the disk full while a checkpoint is written: a real `tidal run tiny-cpu` whose
checkpoint folder (``<trainer.default_local_dir>/<run>/checkpoints``) is a small tmpfs that a filler
file has filled up to half a checkpoint, right after step 1's checkpoint (the driver is SIGKILLed in
step 2, the folder moved onto the tmpfs, the filler written, then `tidal resume`). The next
checkpoint write finds no space: the driver stops with exit 5 and, as its last line, one line naming
the full disk, the path and the resume command, with no traceback; step 1's checkpoint is untouched
(same bytes, loads), no temp file or partial checkpoint is left; and once the filler is deleted
`tidal resume` finishes the run exactly as an uninterrupted one: steps 1..STEPS once each, the same
policy state, every prompt trained exactly once.

The tmpfs needs root to mount; without it the test is skipped."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from driver_support import assert_resumed_exactly, config_args, final_state, run_tidal, store_url
from fault_report import record

from cluster.backends import checkpoint_complete
from cluster.checkpoint_file import read_checkpoint, sha256_file
from flows.errors import EXIT_DISK_FULL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 5  # as tests/integration/test_resume.py's uninterrupted run, which is made once per session
TMPFS_SIZE = "16m"  # a tiny-cpu checkpoint is ~1 MB: room for the whole run once the filler is gone


def _mount_tmpfs(folder: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the disk-full test needs root to mount a tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"the disk-full test could not mount a tmpfs: {done.stderr.strip()}")


def _unmount(folder: Path) -> None:
    if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(folder)], check=True)  # a leftover open file: detach it


def _fill(folder: Path, leave: int) -> Path:
    """A filler file that leaves ``leave`` bytes free on ``folder``'s file system."""
    st = os.statvfs(folder)
    filler = folder / "filler"
    with open(filler, "wb") as fh:
        fh.truncate(0)
        left = st.f_bavail * st.f_frsize - leave
        chunk = b"\0" * (1 << 20)
        while left > 0:
            left -= fh.write(chunk[:left])
    return filler


def test_a_full_disk_stops_the_run_in_one_line_and_resume_finishes_it_exactly(tmp_path, ray_address, uninterrupted):
    straight = store_url(uninterrupted(STEPS), "straight")
    url = store_url(tmp_path, "full")
    code, log = run_tidal(["run", "tiny-cpu", *config_args(tmp_path, ray_address, "full", STEPS)], tmp_path,
                          crash="train:2")
    assert code == -signal.SIGKILL, log[-3000:]
    summary, state, *_ = final_state(url)
    assert state.step == 1 and checkpoint_complete(state.checkpoint.path)
    first = Path(state.checkpoint.path)
    checkpoints = first.parents[1]
    assert checkpoints.name == "checkpoints"

    # the run's checkpoint folder onto a small tmpfs, step 1's checkpoint in it, the rest filled
    aside = checkpoints.with_name("checkpoints.before")
    checkpoints.rename(aside)
    checkpoints.mkdir()
    _mount_tmpfs(checkpoints)
    try:
        shutil.copytree(aside, checkpoints, dirs_exist_ok=True)
        first_sha = sha256_file(first)
        filler = _fill(checkpoints, leave=first.stat().st_size // 2)

        code, log = run_tidal(["resume", summary.uid, "--storage", url], tmp_path)
        last = log.strip().splitlines()[-1]
        print(last)
        assert code == EXIT_DISK_FULL, log[-3000:]
        assert last.startswith("tidal: error: the disk is full") and str(checkpoints) in last, last
        assert f"tidal resume {summary.uid} --storage '{url}'" in last, last
        assert "Traceback" not in log, log[-3000:]
        # the previous checkpoint is intact and loads; nothing half-written is left to be taken for one
        assert sha256_file(first) == first_sha
        assert read_checkpoint(first)["format"]
        files = sorted(p.relative_to(checkpoints).as_posix() for p in checkpoints.rglob("*") if p.is_file())
        assert files == ["filler", "global_step_1/actor.pt"], files

        filler.unlink()
        code, log = run_tidal(["resume", summary.uid, "--storage", url], tmp_path)
        assert code == 0, log[-3000:]
    finally:
        _unmount(checkpoints)

    lost, duplicated = assert_resumed_exactly(straight, url, STEPS)
    record("disk_full", injected=1, survived=1, samples_lost=lost, samples_duplicated=duplicated,
           points=["checkpoint:2"])
