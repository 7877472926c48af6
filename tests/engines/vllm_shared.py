"""The vLLM hosts shared by the engine tests of this folder (starting one takes 20-60 s on CPU).

Three hosts: ``tiny`` serves ``TinyLM`` (``CFG``), ``hf`` a tiny Qwen2 folder (tied embeddings, a
byte-level BPE tokenizer trained in code, 2 heads of 32: vLLM's CPU attention needs a head size
of at least 32) built once per session, and ``tp2`` serves ``TinyLM`` at TP 2 over two worker
processes that we start (``vllm_rank_procs``: vLLM spawns no worker of its own).
``tests/engines/conftest.py`` starts the hosts the selected tests need right after collection (so
start-up is outside every test's timeout) and closes them at the end of the session. Each test builds its own ``VLLMEngine`` on a host: own
requests, version, pause/sleep state and counters.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from data.problems import CharTokenizer
from models.model import TinyLMConfig

TOK = CharTokenizer()
# vLLM's CPU attention needs head_dim >= 32 (TinyLM's test shape, n_embd 32 / 4 heads, has 8).
CFG = TinyLMConfig(vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_embd=64, max_seq_len=64)
MAX_BATCH = 8
HF_HEADS = 2
HF_MAX_LEN = 128

_hosts: dict[str, Any] = {}
_errors: dict[str, BaseException] = {}
_procs: dict[str, Any] = {}
start_s: dict[str, float] = {}
_folder: Path | None = None


def skip_reason() -> str | None:
    from cluster.engines.vllm_engine import vllm_unavailable_reason

    return vllm_unavailable_reason()


def wanted_hosts(nodeid: str) -> set[str]:
    """The hosts a test needs, by its id."""
    if "[vllm-tp2" in nodeid or "test_vllm_rank_engine.py" in nodeid:
        return {"tp2"}
    if "[vllm-hf" in nodeid or "test_vllm_hf_engine.py" in nodeid:
        return {"hf"}
    if "[vllm" in nodeid or "test_vllm_engine.py" in nodeid:
        return {"tiny"}
    return set()


def hf_folder() -> Path:
    """The tiny Qwen2 folder (built on first call; wide init, so greedy choices are never near-ties)."""
    global _folder
    if _folder is None:
        from models.hf import make_tiny_model

        _folder = make_tiny_model(Path(tempfile.mkdtemp(prefix="tidal-vllm-hf-")) / "qwen2", "qwen2",
                                  n_head=HF_HEADS, initializer_range=0.2)
    return _folder


def host(name: str = "tiny") -> Any:
    """The shared ``VLLMHost`` ``name`` (started on first call); a failed start fails every caller."""
    if name in _errors:
        raise RuntimeError(f"the shared vLLM host {name!r} failed to start") from _errors[name]
    if name not in _hosts:
        from cluster.engines.vllm_engine import VLLMHost, hf_model

        t0 = time.perf_counter()
        try:
            model = hf_model(str(hf_folder()), max_model_len=HF_MAX_LEN) if name == "hf" else CFG
            workers = {}
            if name == "tp2":  # two processes of one gloo group host the TP workers (as trainer ranks do)
                from vllm_rank_procs import RankProcs

                _procs[name] = RankProcs(2)
                workers = dict(rank_workers=_procs[name].addresses, rank_ident=str(_procs[name].pids[0]))
            _hosts[name] = VLLMHost(model, max_batch=MAX_BATCH, eos_id=None if name == "hf" else TOK.eos_id,
                                    seed=0, threads=1, **workers)
        except BaseException as exc:
            _errors[name] = exc
            raise
        start_s[name] = time.perf_counter() - t0
    return _hosts[name]


def engine() -> Any:
    from cluster.engines.vllm_engine import VLLMEngine

    return VLLMEngine(CFG, max_batch=MAX_BATCH, eos_id=TOK.eos_id, host=host())


def tp2_engine() -> Any:
    """An engine on the TP-2 host whose workers are two processes we started (``vllm_rank_procs``)."""
    from cluster.engines.vllm_engine import VLLMEngine

    return VLLMEngine(CFG, max_batch=MAX_BATCH, eos_id=TOK.eos_id, host=host("tp2"))


def rank_procs() -> Any:
    """The processes hosting the TP-2 host's workers."""
    host("tp2")
    return _procs["tp2"]


def hf_engine() -> Any:
    from cluster.engines.vllm_engine import VLLMEngine

    shared = host("hf")
    return VLLMEngine(shared.model, max_batch=MAX_BATCH, host=shared)


def close() -> None:
    global _folder
    for name in list(_hosts):
        _hosts.pop(name).close()
    for name in list(_procs):
        _procs.pop(name).close()
    if _folder is not None:
        shutil.rmtree(_folder.parent, ignore_errors=True)
        _folder = None


def weights(seed: int) -> dict[str, Any]:
    """TinyLM weights with a wide head, so greedy choices are never near-ties."""
    import torch

    from models.model import TinyLM

    torch.manual_seed(seed)
    model = TinyLM(CFG)
    torch.nn.init.normal_(model.head.weight, std=0.5)
    return model.state_dict()


def hf_model_of(seed: int) -> Any:
    """The tiny Qwen2 with seed ``seed``'s random weights (seed 0: the folder's), as a trainer holds it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_folder())).eval()


def hf_weights(seed: int) -> dict[str, Any]:
    """``state_dict()`` of ``hf_model_of(seed)``: HF names, the LM head tied to the embedding."""
    return hf_model_of(seed).state_dict()
