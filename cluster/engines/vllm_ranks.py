"""A tensor-parallel vLLM engine whose workers live in processes vLLM did not start: trainer ranks.

A hybrid replica of ``tensor_model_parallel_size`` t spans t trainer ranks of one node. Each of
those rank processes hosts one vLLM worker (``RankWorker``: vLLM's ``WorkerWrapperBase``, on the
rank's own device, beside the rank's training shard) and serves calls to it on a ZMQ socket. The
engine itself (one ``AsyncLLM``, one scheduler) lives in the first rank's process; its engine core
drives the t workers through ``RankExecutor``, an executor that connects to those sockets instead
of spawning workers. vLLM selects it by qualified name (``distributed_executor_backend``), the hook
verl's colocated engines use as well.

Why not vLLM's ``external_launcher``: there every rank runs an engine and a scheduler of its own,
and the t schedulers stay in step only if every rank sees the same requests and aborts at the same
engine step. Our rollouter sends requests and per-request aborts asynchronously (partial rollout),
so they would diverge. One scheduler driving t workers has no such condition.

The workers' distributed environment is the trainer's: the rank process already holds the
training group as its default process group, so vLLM's world is the trainer's ranks and its TP
groups are consecutive runs of t ranks (hybrid k on ranks k·t … k·t + t − 1), the layout
``trainer_rank.hybrid_hosts`` places hybrids in. vLLM forms those groups collectively over the
whole world, so every rank's worker is initialised at the same time (``RankGroup`` builds all the
hybrids of a trainer at once). ``ident`` names the run's shared-memory groups on the host (vLLM's
CPU communicator); the trainer group's own address is unique on a host, so it serves.

The rank loads its worker in place (``RankWorker.load``): the weights of its own training shard,
gathered one parameter at a time, go through vLLM's layerwise reload, and vLLM's weight loader
keeps this worker's TP slice of each. Calls from the engine and local calls run one at a time.
Never imports vLLM or ZMQ at module import (they live in the vLLM venv).
"""

from __future__ import annotations

import functools
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

WORKERS_KEY = "tidal_rank_workers"
"""``additional_config`` key: the workers' addresses (``RankWorker.address``), in TP rank order."""
IDENT_KEY = "tidal_rank_ident"
"""``additional_config`` key: the run's name for the workers' shared-memory groups."""
EXECUTOR = "cluster.engines.vllm_ranks.RankExecutor"
"""``distributed_executor_backend`` of an engine whose workers are ``RankWorker``s."""
_RPC_TIMEOUT_S = float(os.environ.get("TIDAL_VLLM_RANK_RPC_TIMEOUT_S", "600"))


@dataclass(frozen=True)
class WorkerInfo:
    """Where a worker runs: the process, the device and its TP rank (the test of "in the rank's
    process" compares ``pid`` with the rank actor's)."""

    pid: int
    device: str
    tp_rank: int
    tp_size: int
    world_rank: int


def where(worker: Any) -> dict[str, Any]:
    """``WorkerInfo``'s fields of a vLLM worker in this process."""
    import torch.distributed as dist
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return dict(pid=os.getpid(), device=str(worker.device), tp_rank=get_tensor_model_parallel_rank(),
                tp_size=get_tensor_model_parallel_world_size(), world_rank=dist.get_rank())


# ------------------------------------------------------------------------------------------------
# Worker side: in the trainer rank's process


class RankWorker:
    """One vLLM worker hosted in this process, served on a ZMQ socket to the engine's executor.

    ``local_rank`` is the worker's device index in this process (0 for a Ray actor holding one
    GPU, and on CPU). The worker itself is created by the executor's first call (``init_worker``
    carries the engine's config). ``close`` stops serving and shuts the worker down.
    """

    def __init__(self, *, host: str = "127.0.0.1", local_rank: int = 0):
        import zmq

        self.local_rank = local_rank
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.wrapper: Any = None
        self._lock = threading.Lock()  # one call on the worker at a time: the engine's or a local one
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="vllm-rank-worker", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.wrapper is not None and getattr(self.wrapper, "worker", None) is not None

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed.is_set():
            if not poller.poll(timeout=500):  # wakes twice a second only to notice close()
                continue
            request = self._socket.recv()
            try:
                method, args, kwargs = pickle.loads(request)
                with self._lock:
                    reply = ("ok", self._call(method, args, kwargs))
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the engine
                reply = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            try:
                payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # noqa: BLE001 - an unpicklable result is an error too
                payload = pickle.dumps(("error", f"unpicklable result of {method!r}: {exc}"))
            self._socket.send(payload)
        self._socket.close(linger=0)

    def _call(self, method: str | bytes, args: tuple, kwargs: dict) -> Any:
        if method == "init_worker":
            from vllm.v1.worker.worker_base import WorkerWrapperBase

            (all_kwargs,) = args
            mine = dict(all_kwargs[0])
            mine["local_rank"] = self.local_rank
            self.wrapper = WorkerWrapperBase(rpc_rank=0, global_rank=mine["rank"])
            return self.wrapper.init_worker([mine])
        if self.wrapper is None:
            raise RuntimeError(f"{method!r} before init_worker")
        if isinstance(method, bytes):
            import cloudpickle

            result = cloudpickle.loads(method)(self.wrapper.worker, *args, **kwargs)
        else:
            result = getattr(self.wrapper, method)(*args, **kwargs)
        get_output = getattr(result, "get_output", None)  # an async model-runner output: resolve it here
        return get_output() if callable(get_output) and type(result).__name__.startswith("Async") else result

    def run(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(worker)`` here, in the caller's thread, while no engine call runs."""
        if not self.ready:
            raise RuntimeError("this rank's vLLM worker is not initialised yet")
        with self._lock:
            return fn(self.wrapper.worker)

    def where(self) -> WorkerInfo:
        return WorkerInfo(**self.run(where))

    def load(self, named: Iterable[tuple[str, Any]]) -> float:
        """Load ``(checkpoint name, full tensor)`` pairs into this worker in place, one at a time
        (vLLM's layerwise reload: each weight loader keeps this worker's TP slice; a layer is
        processed once all its weights are in). Returns seconds."""
        t0 = time.perf_counter()
        self.run(lambda worker: reload_layerwise(worker, [named]))
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(timeout=5)
        with self._lock:
            wrapper, self.wrapper = self.wrapper, None
            if wrapper is not None and getattr(wrapper, "worker", None) is not None:
                try:
                    wrapper.shutdown()
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
        self._ctx.term()


def reload_layerwise(worker: Any, batches: Iterable[Iterable[tuple[str, Any]]]) -> None:
    """vLLM 0.32's layerwise reload of a worker's model in this process: one reload window, one
    ``model.load_weights`` per batch of (checkpoint name, full tensor) pairs (lazy: a generator
    may gather or receive each as the loader asks), then the derived state refreshed as
    ``Worker.reload_weights`` does. Each weight loader keeps this worker's TP slice; a layer is
    processed once all its weights are in, whichever batch they came in."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    quiet_expected_reload_warnings()
    runner = worker.model_runner
    model = runner.get_model()
    with set_current_vllm_config(worker.vllm_config), no_mtp_completeness_check():
        initialize_layerwise_reload(model)
        try:
            for batch in batches:
                model.load_weights(iter(batch))
        finally:
            # also after a failure: every layer gets its (old or new) tensors back in place
            finalize_layerwise_reload(model, worker.vllm_config.model_config)
    worker._reprocess_tied_heads()
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        getattr(runner, reset, lambda: None)()


def no_mtp_completeness_check() -> Any:
    """vLLM's guard for partial loads of a model with MTP layers (its NCCL engine uses it too)."""
    import contextlib

    try:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
    except ImportError:
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


@functools.cache
def quiet_expected_reload_warnings() -> None:
    """vLLM's layerwise reload warns, at every sync, about the layers a checkpoint never has
    weights for: a tied LM head (``_reprocess_tied_heads`` handles it) and the rotary tables
    (computed, not loaded). Drop those two warnings in the worker; keep every other."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights"
                    and record.args and record.args[0] in ("ParallelLMHead", "RotaryEmbedding"))

    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(keep)


# ------------------------------------------------------------------------------------------------
# Engine side: in the engine core's process


def __getattr__(name: str) -> Any:
    """``RankExecutor`` is built as a subclass of vLLM's ``Executor`` when first asked for (PEP
    562), so this module imports without vLLM."""
    if name == "RankExecutor":
        cls = _make_executor()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _make_executor() -> type:
    from vllm.v1.executor.abstract import Executor

    class RankExecutor(Executor):  # type: ignore[misc, valid-type]
        """vLLM's executor over workers it did not start (``RankWorker``s, one per TP rank, whose
        addresses the engine's ``additional_config`` names): each call goes to every worker at
        once and returns their results in TP rank order; the model's output is TP rank 0's."""

        uses_ray = False
        supports_pp = False

        def _init_executor(self) -> None:
            import zmq

            extra = self.vllm_config.additional_config or {}
            addresses = list(extra.get(WORKERS_KEY) or ())
            world = self.parallel_config.world_size
            if len(addresses) != world:
                raise ValueError(f"{EXECUTOR} needs {world} worker addresses in additional_config[{WORKERS_KEY!r}], "
                                 f"got {len(addresses)}")
            self._ctx = zmq.Context()
            self._sockets = []
            for address in addresses:
                sock = self._ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                self._sockets.append(sock)
            self._addresses = addresses
            self._parent = os.getppid()  # the engine's client: the process whose rank hosts the engine
            self._rpc_lock = threading.Lock()
            ident = str(extra.get(IDENT_KEY) or os.getpid())
            init_method = f"tcp://127.0.0.1:{ident}"  # vLLM names the CPU shared-memory groups after its tail
            all_kwargs = [dict(vllm_config=self.vllm_config, local_rank=0, rank=rank,
                               distributed_init_method=init_method, is_driver_worker=rank == 0)
                          for rank in range(world)]
            self._per_worker("init_worker", [((kw_list,), {}) for kw_list in ([kw] for kw in all_kwargs)])
            self.collective_rpc("init_device")
            self.collective_rpc("load_model")

        def _per_worker(self, method: str | bytes, calls: Sequence[tuple[tuple, dict]],
                        timeout: float | None = None) -> list[Any]:
            import zmq

            deadline = time.monotonic() + (timeout or _RPC_TIMEOUT_S)
            with self._rpc_lock:
                for sock, (args, kwargs) in zip(self._sockets, calls, strict=True):
                    sock.send(pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL))
                replies: list[Any] = [None] * len(self._sockets)
                poller = zmq.Poller()
                for sock in self._sockets:
                    poller.register(sock, zmq.POLLIN)
                pending = {sock: i for i, sock in enumerate(self._sockets)}
                while pending:
                    left_ms = (deadline - time.monotonic()) * 1000
                    if left_ms <= 0:
                        raise TimeoutError(f"vLLM rank workers {sorted(pending.values())} did not answer "
                                           f"{method if isinstance(method, str) else 'a call'} in time")
                    if os.getppid() != self._parent:  # the rank hosting the engine died: so does this process
                        raise RuntimeError("the process that started this engine core is gone")
                    for sock, _ in poller.poll(timeout=min(left_ms, 1000)):
                        i = pending.pop(sock)
                        poller.unregister(sock)
                        replies[i] = pickle.loads(sock.recv())
            errors = [f"worker {i} ({self._addresses[i]}): {body}" for i, (status, body) in enumerate(replies)
                      if status != "ok"]
            if errors:
                raise RuntimeError("; ".join(errors))
            return [body for _, body in replies]

        def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                           kwargs: dict | None = None, non_block: bool = False,
                           unique_reply_rank: int | None = None, **_: Any) -> Any:
            if not isinstance(method, str):
                import cloudpickle

                method = cloudpickle.dumps(method, protocol=pickle.HIGHEST_PROTOCOL)
            call = (tuple(args), dict(kwargs or {}))
            try:
                results = self._per_worker(method, [call] * len(self._sockets), timeout)
                out = results[unique_reply_rank] if unique_reply_rank is not None else results
            except BaseException as exc:
                if not non_block:
                    raise
                future: Future[Any] = Future()
                future.set_exception(exc)
                return future
            if not non_block:
                return out
            future = Future()
            future.set_result(out)
            return future

        def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
            return self.collective_rpc("execute_model", args=(scheduler_output,), non_block=non_block,
                                       unique_reply_rank=0)

        def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
            return self.collective_rpc("sample_tokens", args=(grammar_output,), non_block=non_block,
                                       unique_reply_rank=0)

        def execute_dummy_batch(self) -> None:
            self.collective_rpc("execute_dummy_batch")

        def take_draft_token_ids(self) -> Any:
            return self.collective_rpc("take_draft_token_ids", unique_reply_rank=0)

        def check_health(self) -> None:
            self.collective_rpc("check_health", timeout=30)

        def shutdown(self) -> None:
            """The workers belong to the ranks (``RankWorker.close``): only the sockets go."""
            sockets, self._sockets = getattr(self, "_sockets", []), []
            for sock in sockets:
                sock.close(linger=0)
            ctx = getattr(self, "_ctx", None)
            if ctx is not None:
                ctx.term()
                self._ctx = None

    RankExecutor.__module__ = __name__
    RankExecutor.__qualname__ = "RankExecutor"
    return RankExecutor
