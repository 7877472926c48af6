"""The torch train backend on real (hand-built) GRPO samples: learning, timing, determinism,
checkpoints and weight export."""

from __future__ import annotations

import hashlib
import pickle
import random
from pathlib import Path

import pytest
import torch

from cluster.backends import (
    TIMING_KEYS,
    CheckpointError,
    SimulatedBackend,
    TorchBackend,
    build_backend,
    build_batch,
)
from cluster.backends import base as backend_base
from data.problems import EOS, CharTokenizer, make_problems, reward
from data.types import Response, Sample
from models.model import TinyLM, TinyLMConfig, sequence_logprobs

TOK = CharTokenizer()
PROBLEMS = make_problems("count", 4, seed=0)
CFG = TinyLMConfig(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=32, max_seq_len=32)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The backend sets torch's (process-wide) thread count; give other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def make_backend(**kwargs) -> TorchBackend:
    return TorchBackend(CFG, TOK, PROBLEMS, **{"lr": 1e-2, **kwargs})


@torch.no_grad()
def rollout_logprobs(model: TinyLM, prompt: list[int], response: list[int]) -> list[float]:
    x = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(x[:, :-1]), dim=-1)[0].gather(-1, x[0, 1:, None])[:, 0]
    return logp[len(prompt) - 1 :].tolist()


def make_samples(model: TinyLM | None = None, n: int = 8, seed: int = 0) -> list[Sample]:
    """Per problem, n responses from "random junk" through "right prefix + junk" to exactly right,
    so every group has a spread of rewards. Log-probs come from ``model`` (as an engine would
    report them), or are zeros when no model is given."""
    rng = random.Random(seed)
    samples = []
    for p in PROBLEMS:
        prompt = TOK.encode(p.prompt)
        answer = TOK.encode(p.answer, bos=False) + [EOS]
        responses = []
        for j in range(n):
            k = j % (len(answer) + 1)
            if k == len(answer):
                tokens = list(answer)
            else:
                tokens = answer[:k] + [rng.randrange(3, TOK.vocab_size) for _ in range(rng.randint(1, 3))]
            logprobs = rollout_logprobs(model, prompt, tokens) if model is not None else [0.0] * len(tokens)
            responses.append(Response(tokens=tokens, logprobs=logprobs, finish_reason="stop", min_version=0, max_version=0))
        samples.append(Sample(f"e0-p{p.index}", 0, p.index, prompt, responses, started_version=0))
    return samples


@torch.no_grad()
def greedy_reward(model: TinyLM, max_new: int = 8) -> float:
    total = 0.0
    for p in PROBLEMS:
        seq, out = TOK.encode(p.prompt), []
        for _ in range(max_new):
            t = int(model(torch.tensor([seq]))[0, -1].argmax())
            out.append(t)
            seq.append(t)
            if t == EOS:
                break
        total += reward(p, out, TOK)
    return total / len(PROBLEMS)


def weights(backend) -> dict[str, torch.Tensor]:
    return backend.state_dict_for_rollout()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# -- batch layout --------------------------------------------------------------------------------


def test_the_batch_puts_response_log_probs_and_mask_exactly_under_the_response_tokens():
    s = Sample("e0-p0", 0, 0, [1, 10, 11], [Response([20, 2], [-0.5, -0.25]), Response([21], [-1.5])], 0)
    batch = build_batch([s], pad_id=0, max_seq_len=16)
    assert batch.tokens.tolist() == [[1, 10, 11, 20, 2], [1, 10, 11, 21, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert batch.rollout_logp.tolist() == [[0, 0, -0.5, -0.25], [0, 0, -1.5, 0]]
    assert batch.group_sizes == [2] and batch.response_tokens == 3 and batch.tokens_total == 9


def test_rollout_log_probs_line_up_with_the_models_own_log_probs():
    backend = make_backend()
    samples = make_samples(backend.model)
    batch = build_batch(samples, pad_id=TOK.pad_id, max_seq_len=CFG.max_seq_len)
    with torch.no_grad():
        recomputed = sequence_logprobs(backend.model, batch.tokens, batch.prompt_lens, batch.total_lens)
    assert torch.allclose(recomputed, batch.rollout_logp, atol=1e-5)


def test_a_sequence_longer_than_max_seq_len_is_rejected():
    s = Sample("e0-p0", 0, 0, [1] * 20, [Response([5] * 20, [0.0] * 20)], 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        make_backend().train_step([s])


def test_missing_rollout_log_probs_are_an_error_when_they_are_to_be_used():
    s = make_samples()
    s[0].responses[0].logprobs = []
    with pytest.raises(ValueError, match="use_rollout_log_probs"):
        make_backend().train_step(s)
    # recomputing them instead works on the same batch
    assert make_backend(use_rollout_log_probs=False).train_step(s).metrics["updates"] == 1


# -- learning ------------------------------------------------------------------------------------


def test_training_on_a_fixed_batch_raises_the_greedy_reward_and_the_best_responses_likelihood():
    backend = make_backend(use_rollout_log_probs=False)
    samples = make_samples(backend.model)
    batch = build_batch(samples, pad_id=TOK.pad_id, max_seq_len=CFG.max_seq_len)
    exact = torch.tensor([reward(PROBLEMS[s.prompt_index], r.tokens, TOK) == 1.0 for s in samples for r in s.responses])

    def exact_logp() -> float:
        with torch.no_grad():
            lp = sequence_logprobs(backend.model, batch.tokens, batch.prompt_lens, batch.total_lens).sum(dim=1)
        return float(lp[exact].mean())

    before_reward, before_logp = greedy_reward(backend.model), exact_logp()
    for _ in range(30):
        backend.train_step(samples)
    assert greedy_reward(backend.model) >= before_reward + 0.25
    assert exact_logp() > before_logp + 3.0


def test_with_fixed_rollout_log_probs_the_loss_falls_step_after_step():
    backend = make_backend(lr=3e-3)
    samples = make_samples(backend.model)
    losses = [backend.train_step(samples).metrics["loss"] for _ in range(6)]
    assert losses[-1] < losses[0] - 0.05
    assert all(b <= a + 1e-3 for a, b in zip(losses, losses[1:]))


def test_a_strong_kl_loss_keeps_the_policy_closer_to_the_reference():
    free = make_backend(use_kl_loss=True, kl_loss_coef=0.0, use_rollout_log_probs=False)
    tied = make_backend(use_kl_loss=True, kl_loss_coef=5.0, use_rollout_log_probs=False)
    samples = make_samples()
    for _ in range(10):
        kl_free = free.train_step(samples).metrics["kl"]
        kl_tied = tied.train_step(samples).metrics["kl"]
    assert kl_free > 0.0
    assert kl_tied < 0.5 * kl_free


def test_rollout_log_probs_of_the_current_weights_give_the_same_step_as_recomputing_them():
    a, b = make_backend(), make_backend(use_rollout_log_probs=False)
    samples = make_samples(a.model)
    ra, rb = a.train_step(samples), b.train_step(samples)
    assert ra.metrics["loss"] == pytest.approx(rb.metrics["loss"], abs=1e-6)
    assert ra.metrics["grad_norm"] == pytest.approx(rb.metrics["grad_norm"], rel=1e-4)
    for k, v in weights(a).items():
        assert torch.allclose(v, weights(b)[k], atol=1e-5), k


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradient_accumulation_over_micro_batches_gives_the_one_big_batch_update(mode):
    # eps=1 makes Adam's first update ≈ lr × gradient (with the default eps it is ≈ ±lr for any
    # gradient, so float noise in a near-zero gradient would flip a weight by 2 lr)
    whole = make_backend(loss_agg_mode=mode, lr=1.0, eps=1.0)
    micro = make_backend(loss_agg_mode=mode, lr=1.0, eps=1.0, ppo_micro_batch_size_per_gpu=5)  # 7 passes
    samples = make_samples(whole.model)
    rw, rm = whole.train_step(samples).metrics, micro.train_step(samples).metrics
    assert rm["loss"] == pytest.approx(rw["loss"], abs=1e-6)
    assert rm["actor/grad_norm"] == pytest.approx(rw["actor/grad_norm"], rel=1e-5)
    assert rm["actor/pg_clipfrac"] == pytest.approx(rw["actor/pg_clipfrac"], abs=1e-6)
    assert rm["actor/entropy"] == pytest.approx(rw["actor/entropy"], rel=1e-5)
    for k, v in weights(whole).items():
        assert torch.allclose(v, weights(micro)[k], atol=1e-6), k


def test_lr_warms_up_linearly_from_zero_and_the_first_update_changes_nothing():
    backend = make_backend(lr=1e-2, lr_warmup_steps=2)
    samples = make_samples(backend.model)
    before = weights(backend)
    lrs = [backend.train_step(samples).metrics["actor/lr"]]
    assert_same_weights(weights(backend), before)
    lrs += [backend.train_step(samples).metrics["actor/lr"] for _ in range(3)]
    assert lrs == [0.0, 5e-3, 1e-2, 1e-2]


def test_a_reference_model_is_kept_only_when_the_kl_loss_is_on():
    assert make_backend().ref_model is None
    assert make_backend(use_kl_loss=True).ref_model is not None


def test_sample_scores_when_set_replace_the_built_in_reward():
    samples = make_samples()
    for s in samples:
        s.scores = [1.0 if j == 0 else 0.0 for j in range(len(s.responses))]
    m = make_backend().train_step(samples).metrics
    assert m["critic/score/mean"] == 1.0 / 8
    assert m["reward_mean"] == 1.0 / 8


def test_the_rollout_is_correction_logs_its_weights_statistics():
    backend = make_backend(use_rollout_log_probs=False, rollout_is="token", rollout_is_threshold=2.0)
    samples = make_samples()  # the "engine" reported log-prob 0 for every token
    batch = build_batch(samples, pad_id=TOK.pad_id, max_seq_len=CFG.max_seq_len)
    with torch.no_grad():
        old = sequence_logprobs(backend.model, batch.tokens, batch.prompt_lens, batch.total_lens)
    from cluster.backends.grpo import rollout_is_weights

    expected = rollout_is_weights(old, batch.rollout_logp, batch.mask, level="token", threshold=2.0).stats
    m = backend.train_step(samples).metrics
    assert {k.removeprefix("rollout_corr/"): v for k, v in m.items() if k.startswith("rollout_corr/")} == {
        k: pytest.approx(v, abs=1e-6) for k, v in expected.items()
    }
    assert expected["rollout_is_max"] < 1.0  # every old log-prob is below the reported 0


# -- metrics and timing --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rollout_logp", "kl", "keys"),
    [
        (True, False, {"reward", "adv", "update_actor"}),
        (False, False, {"reward", "old_log_prob", "adv", "update_actor"}),
        (True, True, {"reward", "ref", "adv", "update_actor"}),
        (False, True, set(TIMING_KEYS)),
    ],
)
def test_the_timing_keys_are_the_phases_that_ran_and_are_non_negative(rollout_logp, kl, keys):
    result = make_backend(use_rollout_log_probs=rollout_logp, use_kl_loss=kl).train_step(make_samples())
    assert set(result.timing_s) == keys
    assert all(v >= 0.0 for v in result.timing_s.values())
    assert result.timing_s["update_actor"] > 0.0
    assert result.compute_s == pytest.approx(sum(result.timing_s.values()))


def test_metrics_describe_the_batch_that_was_trained_on():
    samples = make_samples()
    rewards = torch.tensor([reward(PROBLEMS[s.prompt_index], r.tokens, TOK) for s in samples for r in s.responses])
    lengths = [len(r.tokens) for s in samples for r in s.responses]
    m = make_backend(ppo_epochs=3).train_step(samples).metrics
    assert m["reward_mean"] == pytest.approx(float(rewards.mean()))
    assert m["reward_std"] == pytest.approx(float(rewards.std(unbiased=False)))
    assert m["responses"] == 32 and m["samples"] == 4
    assert m["response_tokens"] == sum(lengths)
    assert m["tokens"] == sum(lengths) + sum(len(s.prompt_tokens) * len(s.responses) for s in samples)
    assert m["response_length_mean"] == pytest.approx(sum(lengths) / 32)
    assert m["updates"] == 3
    assert m["critic/score/mean"] == m["reward_mean"]
    assert m["response_length/mean"] == m["response_length_mean"]
    for key in ("loss", "pg_loss", "kl", "approx_kl", "grad_norm", "clip_frac", "actor/pg_loss", "actor/pg_clipfrac",
                "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/kl_loss", "actor/lr"):
        assert key in m


# -- determinism and checkpoints -----------------------------------------------------------------


def test_the_same_seed_gives_the_same_weights_and_step_results_and_another_seed_does_not():
    a, b, c = make_backend(seed=3), make_backend(seed=3), make_backend(seed=4)
    assert_same_weights(weights(a), weights(b))
    assert not torch.equal(weights(a)["head.weight"], weights(c)["head.weight"])
    samples = make_samples()
    for _ in range(2):
        assert a.train_step(samples).metrics == b.train_step(samples).metrics
    assert_same_weights(weights(a), weights(b))


def test_save_then_load_restores_weights_optimizer_and_the_exact_next_step(tmp_path):
    samples = make_samples()
    a = make_backend(use_kl_loss=True, kl_loss_coef=0.1)
    for _ in range(2):
        a.train_step(samples)
    info = a.save_checkpoint(tmp_path / "ckpt.pt")

    # another seed: weights, optimizer and the KL reference must all come from the checkpoint
    b = make_backend(use_kl_loss=True, kl_loss_coef=0.1, seed=99)
    b.load_checkpoint(info.path, expected_sha256=info.sha256)
    assert b.updates == 2
    assert_same_weights(weights(a), weights(b))
    ra, rb = a.train_step(samples), b.train_step(samples)
    assert ra.metrics == rb.metrics
    assert_same_weights(weights(a), weights(b))

    # a backend that only loaded the weights (fresh AdamW moments) would step differently
    c = make_backend(use_kl_loss=True, kl_loss_coef=0.1)
    c.load_checkpoint(info.path)
    c.optimizer.state.clear()
    assert c.train_step(samples).metrics["loss"] == pytest.approx(ra.metrics["loss"])
    assert not torch.equal(weights(c)["head.weight"], weights(a)["head.weight"])


def test_load_restores_the_torch_rng_state(tmp_path):
    backend = make_backend()
    torch.manual_seed(123)
    info = backend.save_checkpoint(tmp_path / "ckpt.pt")
    expected = torch.rand(3)
    torch.manual_seed(999)
    backend.load_checkpoint(info.path)
    assert torch.equal(torch.rand(3), expected)


def test_the_checkpoint_info_reports_the_files_sha256_and_size_and_leaves_no_temp_file(tmp_path):
    backend = make_backend()
    info = backend.save_checkpoint(tmp_path / "sub" / "ckpt.pt")
    data = Path(info.path).read_bytes()
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    assert info.size_bytes == len(data)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["ckpt.pt"]


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    backend = make_backend()
    info = backend.save_checkpoint(tmp_path / "ckpt.pt")
    backend.train_step(make_samples())

    def broken_save(obj, fh):
        fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(backend_base.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        backend.save_checkpoint(tmp_path / "ckpt.pt")
    assert hashlib.sha256(Path(info.path).read_bytes()).hexdigest() == info.sha256
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_a_full_disk_under_torch_save_comes_out_as_enospc_naming_the_checkpoint(tmp_path, monkeypatch):
    import errno

    backend = make_backend()
    info = backend.save_checkpoint(tmp_path / "ckpt.pt")

    def save_on_a_full_disk(obj, fh):  # what torch.save raises when a write hits ENOSPC
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 768 vs 662") from None

    monkeypatch.setattr(backend_base.torch, "save", save_on_a_full_disk)
    with pytest.raises(OSError) as raised:
        backend.save_checkpoint(tmp_path / "ckpt.pt")
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(tmp_path / "ckpt.pt"))
    assert hashlib.sha256(Path(info.path).read_bytes()).hexdigest() == info.sha256
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


class _Payload:
    """Pickles to a call that creates a marker file: proof that unpickling ran code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_load_uses_weights_only_and_rejects_a_checkpoint_carrying_a_pickled_object(tmp_path):
    backend = make_backend()
    info = backend.save_checkpoint(tmp_path / "ckpt.pt")
    payload = torch.load(info.path, weights_only=True)
    marker = tmp_path / "code-ran"
    payload["extra"] = {"evil": _Payload(marker)}
    torch.save(payload, tmp_path / "evil.pt")

    with pytest.raises(pickle.UnpicklingError):
        backend.load_checkpoint(tmp_path / "evil.pt")
    assert not marker.exists()
    # the payload is live: a full unpickle would have run it
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


def test_load_rejects_a_checksum_mismatch_and_a_checkpoint_of_another_shape(tmp_path):
    backend = make_backend()
    info = backend.save_checkpoint(tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="sha256"):
        backend.load_checkpoint(info.path, expected_sha256="0" * 64)
    bigger = TorchBackend(TinyLMConfig(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=48, max_seq_len=32), TOK, PROBLEMS)
    other = bigger.save_checkpoint(tmp_path / "bigger.pt")
    with pytest.raises(CheckpointError, match="shape"):
        backend.load_checkpoint(other.path)
    torch.save({"not": "ours"}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="tidal-train"):
        backend.load_checkpoint(tmp_path / "foreign.pt")


# -- weights for rollout -------------------------------------------------------------------------


def test_state_dict_for_rollout_is_detached_cpu_copies_that_load_into_a_fresh_model():
    backend = make_backend()
    state = backend.state_dict_for_rollout()
    live = backend.model.state_dict()
    assert state.keys() == live.keys()
    for k, v in state.items():
        assert v.device.type == "cpu" and not v.requires_grad
        assert torch.equal(v, live[k])
        assert v.data_ptr() != live[k].data_ptr()
    before = {k: v.clone() for k, v in state.items()}
    backend.train_step(make_samples())
    assert_same_weights(state, before)  # training did not write through the export
    assert not torch.equal(backend.state_dict_for_rollout()["head.weight"], state["head.weight"])
    fresh = TinyLM(CFG)
    fresh.load_state_dict(backend.state_dict_for_rollout(), strict=True)
    assert torch.equal(fresh.head.weight, backend.model.head.weight)


# -- construction from a config ------------------------------------------------------------------


def test_build_backend_reads_the_tiny_cpu_preset():
    from config import load_config

    cfg = load_config("tiny-cpu")
    problems = make_problems(cfg.task.name, 8, cfg.task.seed)
    backend = build_backend(cfg, TOK, problems)
    assert isinstance(backend, TorchBackend)
    assert backend.lr == cfg.actor_rollout_ref.actor.lr
    assert backend.model_cfg.n_embd == cfg.model.n_embd and backend.model_cfg.vocab_size == TOK.vocab_size
    assert backend.use_rollout_log_probs == cfg.async_training.use_rollout_log_probs

    sim_cfg = load_config("tiny-cpu", ["engines.train=simulated", "sim.train_tokens_per_gpu_s=2000"])
    sim = build_backend(sim_cfg, TOK, problems)
    assert isinstance(sim, SimulatedBackend)
    assert sim.per_token_s == pytest.approx(1 / (sim_cfg.trainer_gpus * 2000))
