"""The DeepSpeed backend on CPU: same step as the torch backend, checkpoints, no JIT op builds.

Skipped when DeepSpeed (an optional extra) is not installed.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from cluster.backends import DeepSpeedBackend, TorchBackend, deepspeed_available, shutdown_distributed
from data.problems import EOS, CharTokenizer, make_problems
from data.types import Response, Sample
from models.model import TinyLM, TinyLMConfig

pytestmark = [
    pytest.mark.skipif(
        not deepspeed_available(),
        reason="deepspeed is not installed (optional extra: pip install --no-build-isolation 'deepspeed>=0.16,<0.20')",
    ),
    # DeepSpeed's own use of deprecated torch APIs; not ours to fix
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.distributed.[a-z_]+` is deprecated:FutureWarning"),
]

TOK = CharTokenizer()
PROBLEMS = make_problems("count", 4, seed=0)
CFG = TinyLMConfig(vocab_size=TOK.vocab_size, n_layer=1, n_head=2, n_embd=32, max_seq_len=32)
KWARGS = {"lr": 1e-2, "grad_clip": 1.0, "use_kl_loss": True, "kl_loss_coef": 0.05}
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR")


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The backend sets torch's (process-wide) thread count; give other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    """The backend starts a world-size-1 gloo group and sets the dist env: undo both afterwards
    so no other test in this process inherits them."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    shutdown_distributed()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def make_samples(n: int = 6, seed: int = 0) -> list[Sample]:
    """Hand-built groups with a spread of rewards (junk → right prefix → exact answer)."""
    rng = random.Random(seed)
    samples = []
    for p in PROBLEMS:
        prompt, answer = TOK.encode(p.prompt), TOK.encode(p.answer, bos=False) + [EOS]
        responses = []
        for j in range(n):
            k = j % (len(answer) + 1)
            tokens = list(answer) if k == len(answer) else answer[:k] + [rng.randrange(3, TOK.vocab_size)]
            responses.append(Response(tokens=tokens, logprobs=[-3.0] * len(tokens), finish_reason="stop"))
        samples.append(Sample(f"e0-p{p.index}", 0, p.index, prompt, responses, started_version=0))
    return samples


def close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol, rtol=0) for k in a)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_deepspeed_step_matches_the_torch_step_on_the_same_batch(stage):
    samples = make_samples()
    ref = TorchBackend(CFG, TOK, PROBLEMS, **KWARGS)
    ds = DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=stage, **KWARGS)
    assert close_weights(ref.state_dict_for_rollout(), ds.state_dict_for_rollout(), atol=0)
    for _ in range(2):
        r_ref, r_ds = ref.train_step(samples), ds.train_step(samples)
        assert r_ds.metrics["loss"] == pytest.approx(r_ref.metrics["loss"], abs=1e-5)
        assert r_ds.metrics["grad_norm"] == pytest.approx(r_ref.metrics["grad_norm"], rel=1e-4)
        assert r_ds.metrics["kl"] == pytest.approx(r_ref.metrics["kl"], abs=1e-6)
    assert close_weights(ref.state_dict_for_rollout(), ds.state_dict_for_rollout(), atol=1e-5)
    assert set(r_ds.timing_s) == {"reward", "ref", "adv", "update_actor"}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_accumulating_micro_batches_matches_the_torch_one_batch_step(stage):
    samples = make_samples()  # 24 responses → micro-batches of 5: 5 passes, one optimizer step
    args = {**KWARGS, "lr": 1.0, "eps": 1.0, "loss_agg_mode": "seq-mean-token-mean"}  # update ≈ lr × grad
    ref = TorchBackend(CFG, TOK, PROBLEMS, **args)
    ds = DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=stage, ppo_micro_batch_size_per_gpu=5, **args)
    r_ref, r_ds = ref.train_step(samples), ds.train_step(samples)
    assert r_ds.metrics["loss"] == pytest.approx(r_ref.metrics["loss"], abs=1e-5)
    assert r_ds.metrics["grad_norm"] == pytest.approx(r_ref.metrics["grad_norm"], rel=1e-4)
    assert r_ds.metrics["updates"] == 1
    assert close_weights(ref.state_dict_for_rollout(), ds.state_dict_for_rollout(), atol=1e-5)
    ds.close()


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_deepspeed_checkpoint_round_trips_to_the_exact_next_step(stage, tmp_path):
    samples = make_samples()
    a = DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=stage, **KWARGS)
    for _ in range(2):
        a.train_step(samples)
    info = a.save_checkpoint(tmp_path / "ckpt.pt")

    b = DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=stage, **KWARGS)
    b.load_checkpoint(info.path, expected_sha256=info.sha256)
    assert b.updates == 2
    assert close_weights(a.state_dict_for_rollout(), b.state_dict_for_rollout(), atol=0)
    ra, rb = a.train_step(samples), b.train_step(samples)
    assert rb.metrics == ra.metrics
    assert close_weights(a.state_dict_for_rollout(), b.state_dict_for_rollout(), atol=0)


def test_checkpoints_move_between_the_torch_and_the_zero1_backend(tmp_path):
    samples = make_samples()
    t = TorchBackend(CFG, TOK, PROBLEMS, **KWARGS)
    t.train_step(samples)
    info = t.save_checkpoint(tmp_path / "torch.pt")
    ds = DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=1, **KWARGS)
    ds.load_checkpoint(info.path)
    r_t, r_ds = t.train_step(samples), ds.train_step(samples)
    assert r_ds.metrics["loss"] == pytest.approx(r_t.metrics["loss"], abs=1e-5)
    assert close_weights(t.state_dict_for_rollout(), ds.state_dict_for_rollout(), atol=1e-5)

    back = TorchBackend(CFG, TOK, PROBLEMS, **KWARGS)
    back.load_checkpoint(ds.save_checkpoint(tmp_path / "ds.pt").path)
    assert close_weights(back.state_dict_for_rollout(), ds.state_dict_for_rollout(), atol=0)
    assert back.train_step(samples).metrics["loss"] == pytest.approx(ds.train_step(samples).metrics["loss"], abs=1e-5)


def test_zero3_exports_full_cpu_weights_that_load_into_a_plain_model():
    ds = DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=3, **KWARGS)
    ds.train_step(make_samples())
    state = ds.state_dict_for_rollout()
    fresh = TinyLM(CFG)
    assert state.keys() == fresh.state_dict().keys()
    assert all(v.device.type == "cpu" and v.shape == fresh.state_dict()[k].shape for k, v in state.items())
    fresh.load_state_dict(state, strict=True)


def test_no_deepspeed_op_is_compiled_on_cpu():
    DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=1, **KWARGS)
    import deepspeed.comm.comm as ds_comm
    import deepspeed.ops as ds_ops

    assert ds_ops.__compatible_ops__["deepspeed_shm_comm"] is False
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None
    assert torch.distributed.get_backend() == "gloo" and torch.distributed.get_world_size() == 1


def test_after_close_and_shutdown_a_new_backend_starts_a_fresh_group_and_trains():
    first = DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=1, **KWARGS)
    first.close()
    assert shutdown_distributed() is True
    assert not torch.distributed.is_initialized()
    second = DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=1, **KWARGS)
    assert torch.distributed.is_initialized()
    assert second.train_step(make_samples()).metrics["updates"] == 1


def test_an_unknown_zero_stage_is_rejected():
    with pytest.raises(ValueError, match="zero_stage"):
        DeepSpeedBackend(CFG, TOK, PROBLEMS, zero_stage=4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_deepspeed_checkpoint_of_an_hf_model_with_tied_embeddings_round_trips(stage, tmp_path):
    """A Qwen2 whose output head shares the embedding (``tie_word_embeddings``: the state dict
    lists both names, ``named_parameters`` only the embedding) saves and loads at every stage."""
    import transformers
    from test_hf_training import make_samples as hf_samples
    from test_hf_training import tiny_qwen2, tiny_tokenizer

    def tied(seed):
        model = tiny_qwen2(seed)
        model.config.tie_word_embeddings = True
        model.tie_weights()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        return model

    assert transformers  # the HF models are built from configs, nothing downloaded
    a = DeepSpeedBackend(None, tiny_tokenizer(), [], model=tied(0), zero_stage=stage, lr=5e-3)
    samples = hf_samples(a.model)
    a.train_step(samples)
    info = a.save_checkpoint(tmp_path / "actor.pt", export_hf=False)
    b = DeepSpeedBackend(None, tiny_tokenizer(), [], model=tied(1), zero_stage=stage, lr=5e-3)
    b.load_checkpoint(info.path, expected_sha256=info.sha256)
    assert b.train_step(samples).metrics["loss"] == a.train_step(samples).metrics["loss"]
    for name, value in a.state_dict_for_rollout().items():
        assert torch.equal(b.state_dict_for_rollout()[name], value), name
    a.close()
    b.close()
