"""`tidal run tiny-hf --set trainer.n_gpus_per_node=2` end to end on a real Ray cluster and
Prefect: a fresh working directory gets the preset's files on first use; the trainer is two rank
actors (FSDP2 over gloo); the run lends its hybrid replicas and takes them back, logs
`val-core/tidal/arith/reward/mean@1`, leaves one DCP shard per rank at every step, writes Hugging
Face exports (gathered on rank 0) that transformers loads and that greedy-decode what the
trainer's model decodes; killed mid-run (SIGKILL), `tidal resume` ends with every prompt of the
uninterrupted run trained exactly once. (One-rank runs are the other integration tests'.)"""

from __future__ import annotations

import signal

import pytest
from driver_support import config_args, final_state, run_tidal, store_url, switch_kinds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * 600 + 120)]
STEPS = 4
KEY = "val-core/tidal/arith/reward/mean@1"
TIMEOUT_S = 600  # one process: the first builds the files, then Prefect and Ray start (slow on a busy 2-core box)


def hf_args(tmp_path, ray_address, name):
    return [*config_args(tmp_path, ray_address, name, STEPS), "--set", "trainer.test_freq=2",
            "--set", "actor_rollout_ref.rollout.n=4", "--set", "trainer.n_gpus_per_node=2"]


def greedy_pair(run_dir, step: int) -> tuple[list[int], list[int]]:
    """Greedy tokens of the step's HF export (loaded by transformers) and of the trainer's model
    restored from the same step's sharded checkpoint (into one unsharded model: DCP reshards),
    on the first validation prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.builders import backend_factory
    from cluster.data_builders import dataset_for, tokenizer_for
    from config import load_config
    from config.loader import RESOLVED_FILENAME

    cfg = load_config(run_dir / RESOLVED_FILENAME)
    folder = run_dir / "checkpoints" / f"global_step_{step}"
    export = AutoModelForCausalLM.from_pretrained(folder / "huggingface", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(folder / "huggingface", local_files_only=True)
    assert tok.get_vocab() == tokenizer_for(cfg).get_vocab()
    trainer = backend_factory(cfg)()
    assert sorted(p.name for p in (folder / "actor").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "tidal-commit.json"]  # a shard per rank
    trainer.load_checkpoint(folder / "actor" / "tidal-commit.json")
    prompt = torch.tensor([list(dataset_for(cfg, tok, split="val")[0].prompt_tokens)])
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)
    return (export.generate(prompt, **kwargs)[0, prompt.shape[1]:].tolist(),
            trainer.model.eval().generate(prompt, **kwargs)[0, prompt.shape[1]:].tolist())


def test_tiny_hf_lends_validates_exports_and_resumes_every_prompt_exactly_once(tmp_path, ray_address):
    code, log = run_tidal(["run", "tiny-hf", *hf_args(tmp_path, ray_address, "straight")], tmp_path, timeout=TIMEOUT_S)
    assert code == 0, log[-3000:]
    assert "tidal: built the tiny-hf model and data in runs/tiny-hf/" in log
    url = store_url(tmp_path, "straight")
    summary, _, rows, want_prompts = final_state(url)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # the step-counting policy lends after odd steps; the next step takes the hybrids back
    lend, take_back = ["hybrid_sync", "activate", "rebalance"], ["deactivate"]
    assert switch_kinds(url) == {1: lend, 2: take_back, 3: lend, 4: take_back}
    assert all(r["weight_sync/collective/gb"] > 0 for r in rows)  # the run names its transport
    assert [sorted(k for k in r if k.startswith("val-core/")) for r in rows] == [
        [f"{KEY}/before_train"], [KEY], [], [KEY]]
    assert all(0.0 <= r[k] <= 1.0 for r in rows for k in r if k.startswith("val-core/"))
    run_dir = tmp_path / "straight" / summary.uid
    export_tokens, trainer_tokens = greedy_pair(run_dir, STEPS)
    assert export_tokens == trainer_tokens

    args = hf_args(tmp_path, ray_address, "crashed")
    code, log = run_tidal(["run", "tiny-hf", *args], tmp_path, crash="train:3", timeout=TIMEOUT_S)
    assert code == -signal.SIGKILL, log[-3000:]
    crashed = store_url(tmp_path, "crashed")
    summary, state, *_ = final_state(crashed)
    assert state.step == 2
    code, log = run_tidal(["resume", summary.uid, "--storage", crashed], tmp_path, timeout=TIMEOUT_S)
    assert code == 0, log[-3000:]
    got_summary, _, got_rows, got_prompts = final_state(crashed)
    assert (got_summary.status, [r["step"] for r in got_rows]) == ("finished", list(range(1, STEPS + 1)))
    assert len(got_prompts) == len(set(got_prompts)) == STEPS * 16
    assert sorted(got_prompts) == sorted(want_prompts)
