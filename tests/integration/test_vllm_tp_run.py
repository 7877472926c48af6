"""`tidal run tiny-hf-vllm` with a TP-2 hybrid on 2 trainer ranks and a TP-2 standalone, SIGKILLed
while the hybrid is lent and resumed: the hybrid is lent and taken back at least 3 times, the requests a
take-back aborts resume from their partial tokens on the standalone, every prompt is trained on
exactly once, the resumed run ends in the state an uninterrupted one ends in (a policy whose state
depends only on step numbers), and no vLLM worker process ever runs under a trainer rank (the
hybrid's TP workers live in the ranks' own processes), while the standalone's do run under it.

Runs where ``vllm`` imports (the vLLM venv, ``.ci/vllm.sh``); skips with the reason elsewhere.
"""

from __future__ import annotations

import signal
import threading

import psutil
import pytest
from driver_support import final_state, run_tidal, store_url, switch_kinds

from cluster.engines.vllm_engine import vllm_unavailable_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(vllm_unavailable_reason() is not None, reason=str(vllm_unavailable_reason())),
]

STEPS = 4
POLICY = "step_counting_policy:LendingStepCountingPolicy"  # lends after every step; its state depends on step numbers only
TP2 = ["--set", "trainer.n_gpus_per_node=2", "--set", "rollout.n_gpus_per_node=2",
       "--set", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]


class WorkerWatch:
    """Samples the process table every 0.25 s: vLLM's own worker processes (``VLLM::Worker…``),
    each with whether a trainer rank actor is among its ancestors."""

    def __init__(self):
        self.under_rank: set[str] = set()
        self.elsewhere: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> WorkerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            for proc in psutil.process_iter(["pid", "cmdline"]):
                title = " ".join(proc.info["cmdline"] or ())
                if not title.startswith("VLLM::Worker"):
                    continue
                try:
                    ancestors = [" ".join(p.cmdline()) for p in proc.parents()]
                except psutil.Error:
                    continue
                where = self.under_rank if any("TrainRankActor" in a for a in ancestors) else self.elsewhere
                where.add(f"{proc.info['pid']} {title}")


def test_a_tp2_hybrid_run_lends_three_times_and_resumes_exactly_after_a_sigkill(tmp_path, ray_address):
    url = store_url(tmp_path, "tp2")
    args = [*TP2, "--set", f"storage.url={url}", "--set", f"trainer.default_local_dir={tmp_path}/runs",
            "--set", f"ray.address={ray_address}", "--set", f"trainer.total_training_steps={STEPS}",
            "--set", f"async_training.dynamic_schedule_policy={POLICY}", "--set", "trainer.test_freq=0",
            "--set", "trainer.val_before_train=false",
            # take the hybrid back at once, mid-generation, and give it responses long enough to
            # still be running then: every take-back aborts requests that must resume
            "--set", "async_training.dynamic_schedule_deactivate_ratio=0", "--set", "data.max_response_length=32"]
    with WorkerWatch() as watch:
        # killed at step 3 while the hybrid lent after step 2 still generates
        code, log = run_tidal(["run", "tiny-hf-vllm", *args], tmp_path, crash="wait_for_samples:3", timeout=600)
        assert code == -signal.SIGKILL, log[-3000:]
        summary, state, *_ = final_state(url)
        assert state.step == 2
        code, log = run_tidal(["resume", summary.uid, "--storage", url], tmp_path, timeout=600)
        assert code == 0, log[-3000:]
    summary, state, rows, prompts = final_state(url)
    assert summary.status == "finished"
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # the policy's state depends on step numbers and sample counts only: an uninterrupted run ends here too
    assert state.policy_state["steps_seen"] == list(range(1, STEPS + 1))
    per_step = state.policy_state["expected_seen"][0]
    assert state.policy_state["expected_seen"] == [per_step * k for k in range(1, STEPS + 1)]
    # every prompt trained on exactly once, none lost to the kill
    assert len(prompts) == len(set(prompts)) == per_step * STEPS
    # lent after steps 1, 2 and 3 (the resumed process lends again); taken back at steps 2, 3 and 4
    kinds = switch_kinds(url)
    lends = [s for s, k in kinds.items() if "activate" in k]
    take_backs = [s for s, k in kinds.items() if "deactivate" in k]
    assert len(lends) >= 3 and len(take_backs) >= 3, kinds
    # the take-backs aborted requests in flight; they resumed from their partial tokens (re-prefilled)
    # on the standalone, the only replica routable once the hybrid is taken back
    assert sum(r.get("waste/aborted_tokens", 0) for r in rows) > 0
    assert sum(r.get("waste/reprefilled_tokens", 0) for r in rows) > 0
    # the hybrid's TP workers are the ranks' own processes; only the standalone's are vLLM's own
    assert watch.under_rank == set(), watch.under_rank
    assert watch.elsewhere, "the watch saw no vLLM worker at all (the standalone's TP workers): it watched nothing"
