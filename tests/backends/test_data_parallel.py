"""Data-parallel GRPO over a real gloo group: 2 ranks (one process each) against 1 rank on the same
samples and seed give the same losses and the same weights after 3 updates, for FSDP2 (the torch
backend) and ZeRO 1-3 (DeepSpeed), with uneven shares, micro-batches, recomputed log-probs and a
rank whose share is empty; and the sharded checkpoint (a DCP shard per rank, rank 0's commit
marker) saved synchronously or in the background resumes to the exact next step, at the same
rank count or at another (DCP reshards)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from dp_support import train_on_ranks
from test_torch_backend import CFG, PROBLEMS, TOK, make_samples

from cluster.backends import CheckpointError, DeepSpeedBackend, TorchBackend, deepspeed_available
from cluster.backends import distributed as dp

pytestmark = pytest.mark.slow

UPDATES = 3
LOSS_RTOL = 1e-6
"""Sums of float32 partial losses in another order: the losses agree to about 1e-8 relative."""
WEIGHT_ATOL = 2e-5
"""After 3 AdamW updates at lr 1e-2 the weights agree to ~1e-6 (8e-6 with recomputed log-probs):
the 2-rank gradient is the same sum in another order."""


def make_torch(**kwargs) -> TorchBackend:
    return TorchBackend(CFG, TOK, PROBLEMS, lr=1e-2, seed=0, **kwargs)


def make_deepspeed(**kwargs) -> DeepSpeedBackend:
    return DeepSpeedBackend(CFG, TOK, PROBLEMS, lr=1e-2, seed=0, **kwargs)


def assert_equivalent(one: dict, two: dict) -> None:
    losses_1 = [m["loss"] for m in one["metrics"]]
    losses_2 = [m["loss"] for m in two["metrics"]]
    assert losses_2 == pytest.approx(losses_1, rel=LOSS_RTOL)
    for key in ("reward_mean", "responses", "response_tokens", "samples"):
        assert two["metrics"][-1][key] == pytest.approx(one["metrics"][-1][key], rel=1e-9), key
    assert one["weights"].keys() == two["weights"].keys()
    for name, value in one["weights"].items():
        assert torch.allclose(two["weights"][name], value, rtol=0, atol=WEIGHT_ATOL), name
    # and training moved them: the comparison is not of two untouched models
    assert not torch.equal(one["weights"]["head.weight"], make_torch().state_dict_for_rollout()["head.weight"])


TORCH_CASES = {
    "token-mean, one pass": dict(),
    "token-mean, micro-batches of 3 (ranks run 6 and 3 passes)": dict(ppo_micro_batch_size_per_gpu=3),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum", ppo_micro_batch_size_per_gpu=5),
    "seq-mean-token-mean, recomputed log-probs": dict(loss_agg_mode="seq-mean-token-mean",
                                                       use_rollout_log_probs=False, ppo_micro_batch_size_per_gpu=3),
    "KL loss against the frozen reference": dict(use_kl_loss=True, kl_loss_coef=0.1, ppo_micro_batch_size_per_gpu=4),
}


@pytest.mark.parametrize("case", TORCH_CASES, ids=list(TORCH_CASES))
def test_two_fsdp2_ranks_train_like_one_rank(case):
    samples = make_samples(n=8)[:3]  # 2 samples on rank 0, 1 on rank 1
    make = functools.partial(make_torch, **TORCH_CASES[case])
    one = train_on_ranks(1, make, samples, UPDATES)[0]
    two = train_on_ranks(2, make, samples, UPDATES)
    assert_equivalent(one, two[0])
    assert two[1]["weights"] == {}  # gathered on rank 0 only


def test_a_rank_with_no_sample_still_trains_with_the_group():
    samples = make_samples(n=4)[:1]
    one = train_on_ranks(1, make_torch, samples, UPDATES)[0]
    two = train_on_ranks(2, make_torch, samples, UPDATES)
    assert_equivalent(one, two[0])
    assert two[1]["metrics"][-1]["samples"] == 1.0  # every rank reports the group's numbers


def _is_sharded(backend, rank):
    return dp.is_sharded(backend.model), backend.rank


def test_the_torch_backend_of_a_rank_group_is_sharded_with_fsdp2():
    two = train_on_ranks(2, make_torch, make_samples(n=2)[:2], 1, then=_is_sharded)
    assert [r["extra"] for r in two] == [(True, dp.RankInfo(0, 2)), (True, dp.RankInfo(1, 2))]


@pytest.mark.skipif(not deepspeed_available(), reason="deepspeed is not installed (make setup installs it)")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_zero_ranks_train_like_one_rank(stage):
    samples = make_samples(n=8)[:3]
    make = functools.partial(make_deepspeed, zero_stage=stage, ppo_micro_batch_size_per_gpu=3)
    one = train_on_ranks(1, make, samples, UPDATES)[0]
    two = train_on_ranks(2, make, samples, UPDATES)
    assert_equivalent(one, two[0])


# -- sharded checkpoints ---------------------------------------------------------------------------


def _save(backend, rank, *, folder: str, async_save: bool):
    info = backend.save_checkpoint(Path(folder) / "actor.pt", export_hf=False, async_save=async_save)
    return {"returned": info, "done": backend.wait_checkpoint()}


def _load_and_step(backend, rank, *, marker: str, samples):
    backend.load_checkpoint(marker)
    loaded = backend.updates
    metrics = backend.train_step(dp.split(samples, backend.rank.world)[rank]).metrics
    return {"updates": loaded, "loss": metrics["loss"]}


def save(folder, async_save):
    return functools.partial(_save, folder=str(folder), async_save=async_save)


def load_and_step(marker, samples):
    return functools.partial(_load_and_step, marker=str(marker), samples=samples)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_sharded_checkpoint_holds_a_shard_per_rank_and_resumes_exactly(tmp_path, async_save):
    samples = make_samples(n=4)[:3]
    saved = train_on_ranks(2, make_torch, samples, 2, then=save(tmp_path, async_save))
    folder = tmp_path / "actor"
    marker = json.loads((folder / dp.COMMIT_MARKER).read_text())
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", dp.COMMIT_MARKER]
    assert marker["world"] == 2 and marker["updates"] == 2 and set(marker["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    info = saved[0]["extra"]["returned"]
    assert info.path == str(folder / dp.COMMIT_MARKER)
    assert info.sha256 == ""  # the commit marker, not a digest, says it is complete
    if async_save:  # the save in flight finished on every rank, rank 0 wrote the marker
        assert saved[0]["extra"]["done"].size_bytes == sum(marker["files"].values())

    straight = train_on_ranks(2, make_torch, samples, 3)  # the uninterrupted run's third update
    resumed = train_on_ranks(2, make_torch, samples, 0, then=load_and_step(folder / dp.COMMIT_MARKER, samples))
    assert resumed[0]["extra"]["updates"] == 2
    assert resumed[0]["extra"]["loss"] == straight[0]["metrics"][2]["loss"]
    for name, value in straight[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][name], value), name


def test_a_sharded_checkpoint_loads_at_another_rank_count(tmp_path):
    samples = make_samples(n=4)[:3]
    train_on_ranks(2, make_torch, samples, 2, then=save(tmp_path, True))
    marker = str(tmp_path / "actor" / dp.COMMIT_MARKER)
    straight = train_on_ranks(2, make_torch, samples, 3)
    on_one = train_on_ranks(1, make_torch, samples, 0, then=load_and_step(marker, samples))[0]
    assert on_one["extra"] == {"updates": 2, "loss": pytest.approx(straight[0]["metrics"][2]["loss"], rel=LOSS_RTOL)}
    for name, value in straight[0]["weights"].items():
        assert torch.allclose(on_one["weights"][name], value, rtol=0, atol=WEIGHT_ATOL), name


def test_a_single_file_checkpoint_loads_into_a_rank_group(tmp_path):
    samples = make_samples(n=4)[:3]
    one = make_torch()
    for _ in range(2):
        one.train_step(samples)
    one.save_checkpoint(tmp_path / "actor.pt", export_hf=False)
    after = one.train_step(samples).metrics["loss"]
    two = train_on_ranks(2, make_torch, samples, 0, then=load_and_step(tmp_path / "actor.pt", samples))
    assert two[0]["extra"] == {"updates": 2, "loss": pytest.approx(after, rel=LOSS_RTOL)}


def _load_error(backend, rank, *, marker: str):
    with pytest.raises(CheckpointError) as err:
        backend.load_checkpoint(marker)
    return str(err.value)


def load_error(marker):
    return functools.partial(_load_error, marker=str(marker))


def test_a_checkpoint_whose_save_was_cut_off_is_refused(tmp_path):
    samples = make_samples(n=2)[:2]
    train_on_ranks(2, make_torch, samples, 1, then=save(tmp_path, False))
    (tmp_path / "actor" / dp.COMMIT_MARKER).unlink()  # as if killed before rank 0 wrote it
    errors = train_on_ranks(2, make_torch, samples, 0,
                            then=load_error(tmp_path / "actor" / dp.COMMIT_MARKER))
    assert "incomplete checkpoint" in errors[0]["extra"]


def test_a_truncated_shard_is_refused(tmp_path):
    samples = make_samples(n=2)[:2]
    train_on_ranks(2, make_torch, samples, 1, then=save(tmp_path, False))
    shard = tmp_path / "actor" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    errors = train_on_ranks(2, make_torch, samples, 0,
                            then=load_error(tmp_path / "actor" / dp.COMMIT_MARKER))
    assert "__1_0.distcp" in errors[0]["extra"] and "bytes" in errors[0]["extra"]


def test_split_deals_contiguous_shares_differing_by_at_most_one():
    assert dp.split(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert dp.split([1], 2) == [[1], []]


@pytest.mark.skipif(not deepspeed_available(), reason="deepspeed is not installed (make setup installs it)")
def test_a_zero_group_checkpoint_is_one_file_gathered_by_rank_0_and_resumes_exactly(tmp_path):
    samples = make_samples(n=4)[:3]
    make = functools.partial(make_deepspeed, zero_stage=2)
    saved = train_on_ranks(2, make, samples, 2, then=save(tmp_path, True))
    assert [p.name for p in tmp_path.iterdir()] == ["actor.pt"]  # rank 1 wrote nothing
    assert saved[0]["extra"]["done"].sha256 != ""  # rank 0's background write finished, digest known
    straight = train_on_ranks(2, make, samples, 3)
    resumed = train_on_ranks(2, make, samples, 0, then=load_and_step(tmp_path / "actor.pt", samples))
    assert resumed[0]["extra"] == {"updates": 2, "loss": straight[0]["metrics"][2]["loss"]}
    for name, value in straight[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][name], value), name


class _RunsCode:
    """A pickle that creates a file when loaded (what a planted checkpoint could do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_sharded_checkpoint_whose_metadata_would_run_code_is_refused_before_dcp_reads_it(tmp_path):
    import pickle

    from cluster.backends import UnsafeCheckpointError

    train_on_ranks(2, make_torch, make_samples(n=2)[:2], 1, then=save(tmp_path, False))
    folder, ran = tmp_path / "actor", tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(ran))))
    marker = json.loads((folder / dp.COMMIT_MARKER).read_text())
    marker["files"][".metadata"] = (folder / ".metadata").stat().st_size  # the marker made to match
    (folder / dp.COMMIT_MARKER).write_text(json.dumps(marker))
    with pytest.raises(UnsafeCheckpointError) as refused:
        make_torch().load_checkpoint(folder / dp.COMMIT_MARKER)
    assert "refused to load" in str(refused.value) and "names io.open" in str(refused.value)
    assert "\n" not in str(refused.value) and not ran.exists()
