"""The simulated train backend spends time by the cost model and behaves like a backend."""

from __future__ import annotations


import pytest
import torch

from cluster.backends import TIMING_KEYS, CheckpointError, SimulatedBackend, TorchBackend
from models.model import TinyLMConfig
from data.problems import CharTokenizer, make_problems
from data.types import Response, Sample

TOK = CharTokenizer()


def samples(count: int, prompt_len: int = 4, response_len: int = 6, n: int = 2) -> list[Sample]:
    return [
        Sample(
            f"e0-p{i}",
            0,
            i,
            [1] * prompt_len,
            [Response([5 + j] * response_len, [-1.0] * response_len) for j in range(n)],
            started_version=0,
        )
        for i in range(count)
    ]


class FakeSleep:
    def __init__(self):
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def test_it_sleeps_fixed_plus_per_token_cost_split_by_the_phase_fractions():
    sleep = FakeSleep()
    backend = SimulatedBackend(
        per_token_s=0.001,
        fixed_s=0.5,
        phase_fractions={"reward": 1, "old_log_prob": 1, "ref": 2, "adv": 1, "update_actor": 5},
        use_rollout_log_probs=False,
        use_kl_loss=True,
        sleep=sleep,
    )
    batch = samples(3)  # 3 samples × 2 responses × (4 + 6) tokens = 60 tokens
    assert backend.tokens_of(batch) == 60
    backend.train_step(batch)
    cost = 0.5 + 0.001 * 60
    assert sum(sleep.calls) == pytest.approx(cost)
    assert sleep.calls == pytest.approx([cost * f for f in (0.1, 0.1, 0.2, 0.1, 0.5)])


def test_phases_that_do_not_run_are_absent_and_the_rest_renormalised():
    sleep = FakeSleep()
    backend = SimulatedBackend(per_token_s=0.0, fixed_s=1.0, sleep=sleep)  # rollout log-probs, no KL
    result = backend.train_step(samples(1))
    assert set(result.timing_s) == {"reward", "adv", "update_actor"}
    assert sum(backend.phase_fractions.values()) == pytest.approx(1.0)
    assert sum(sleep.calls) == pytest.approx(1.0)
    with_all = SimulatedBackend(per_token_s=0.0, fixed_s=1.0, use_rollout_log_probs=False, use_kl_loss=True, sleep=FakeSleep())
    assert set(with_all.train_step(samples(1)).timing_s) == set(TIMING_KEYS)


def test_twice_the_tokens_cost_twice_the_time_split_over_the_reported_phases():
    # The cost model, not the wall clock (a loaded machine must not fail this).
    sleep = FakeSleep()
    backend = SimulatedBackend(per_token_s=0.002, fixed_s=0.0, sleep=sleep)
    small, large = samples(2), samples(4)  # 40 and 80 tokens → 0.08 s and 0.16 s
    r_small = backend.train_step(small)
    small_calls = list(sleep.calls)
    r_large = backend.train_step(large)
    large_calls = sleep.calls[len(small_calls):]
    assert sum(small_calls) == pytest.approx(0.08) and sum(large_calls) == pytest.approx(0.16)
    assert large_calls == pytest.approx([2 * c for c in small_calls])
    assert set(r_small.timing_s) == set(r_large.timing_s) == set(backend.phase_fractions)


def test_a_fixed_cost_dominates_a_tiny_batch():
    sleep = FakeSleep()
    backend = SimulatedBackend(per_token_s=1e-4, fixed_s=0.2, sleep=sleep)
    backend.train_step(samples(1))
    assert sum(sleep.calls) == pytest.approx(0.2 + 1e-4 * 20)


def test_metrics_are_plausible_and_deterministic_for_a_seed():
    a, b, c = (SimulatedBackend(per_token_s=0.0, seed=s, sleep=FakeSleep()) for s in (1, 1, 2))
    batch = samples(4)
    ma, mb, mc = a.train_step(batch).metrics, b.train_step(batch).metrics, c.train_step(batch).metrics
    assert ma == mb
    assert ma["reward_mean"] != mc["reward_mean"]
    assert 0.0 <= ma["reward_mean"] <= 1.0 and ma["reward_std"] >= 0.0
    assert ma["tokens"] == 80 and ma["response_tokens"] == 48 and ma["responses"] == 8 and ma["samples"] == 4
    assert ma["updates"] == 1
    assert a.train_step(batch).metrics["loss"] < ma["loss"]  # the fake loss falls with updates


def test_with_problems_it_scores_responses_with_the_real_reward():
    problems = make_problems("count", 2, seed=0)
    answer = TOK.encode(problems[0].answer, bos=False) + [TOK.eos_id]
    sample = Sample("e0-p0", 0, 0, TOK.encode(problems[0].prompt), [Response(answer, [0.0] * len(answer)), Response([3], [0.0])], 0)
    backend = SimulatedBackend(per_token_s=0.0, problems=problems, tokenizer=TOK, sleep=FakeSleep())
    assert backend.train_step([sample]).metrics["reward_mean"] == pytest.approx(0.5)


def test_the_fake_state_dict_tracks_updates_and_checkpoints_round_trip(tmp_path):
    backend = SimulatedBackend(per_token_s=0.0, sleep=FakeSleep())
    for _ in range(3):
        backend.train_step(samples(1))
    state = backend.state_dict_for_rollout()
    assert torch.equal(state["weight"], torch.full((16,), 3.0))
    info = backend.save_checkpoint(tmp_path / "sim.pt")
    fresh = SimulatedBackend(per_token_s=0.0, sleep=FakeSleep())
    fresh.load_checkpoint(info.path, expected_sha256=info.sha256)
    assert fresh.updates == 3
    assert torch.equal(fresh.state_dict_for_rollout()["weight"], state["weight"])


def test_it_refuses_a_checkpoint_written_by_another_backend(tmp_path):
    torch_backend = TorchBackend(TinyLMConfig(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=16, max_seq_len=16), TOK, [])
    info = torch_backend.save_checkpoint(tmp_path / "torch.pt")
    with pytest.raises(CheckpointError, match="torch"):
        SimulatedBackend(per_token_s=0.0).load_checkpoint(info.path)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"per_token_s": -1.0}, ">= 0"),
        ({"per_token_s": 0.0, "phase_fractions": {"values": 1.0}}, "unknown timing keys"),
        ({"per_token_s": 0.0, "phase_fractions": {"reward": -1.0}}, ">= 0"),
        ({"per_token_s": 0.0, "phase_fractions": {"ref": 1.0}}, "sum to > 0"),  # ref dropped without KL
    ],
)
def test_bad_cost_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimulatedBackend(**kwargs)


def test_an_empty_batch_is_rejected():
    with pytest.raises(ValueError, match="at least one sample"):
        SimulatedBackend(per_token_s=0.0).train_step([])


def _group_backend() -> SimulatedBackend:
    return SimulatedBackend(per_token_s=0.001, fixed_s=0.5, sleep=FakeSleep())


def _slept_and_saved(folder: str, backend: SimulatedBackend, rank: int) -> tuple[float, str]:
    info = backend.save_checkpoint(f"{folder}/ckpt.pt")
    return sum(backend._sleep.calls), info.sha256


@pytest.mark.slow  # two spawned processes over gloo
def test_each_rank_of_a_group_spends_the_whole_micro_steps_cost_and_reports_the_groups_metrics(tmp_path):
    # a trainer of 2 rank actors deals 3 samples as 2 + 1; the cost model is the whole trainer's
    # (per_token_s of all its GPUs), so every rank must spend what one backend spends on all 3
    import functools

    from dp_support import train_on_ranks

    batch = samples(3)
    alone = _group_backend()
    expected = alone.train_step(batch).metrics
    ranks = train_on_ranks(2, _group_backend, batch, 1, then=functools.partial(_slept_and_saved, str(tmp_path)))
    for rank in ranks:
        (metrics,) = rank["metrics"]
        assert metrics == pytest.approx(expected)
        assert rank["extra"][0] == pytest.approx(0.5 + 0.001 * 60)
    # the one state is written once, by rank 0 (the others name the file)
    assert ranks[0]["extra"][1] and ranks[1]["extra"][1] == ""
    assert (tmp_path / "ckpt.pt").exists()
