"""Config → the data plane: plain constructor arguments and factories, then the named actors.

The only module of ``cluster`` that reads a ``TidalConfig``. ``DataPlane.build`` starts the
actors of one run inside the run's Ray namespace; ``DataPlane.attach`` finds them again from any
process (a Prefect task on a Ray worker, say).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.actors import (
    CONTROLLER,
    ROLLOUT_SERVICE,
    TRAINER,
    ControllerActor,
    ReplicaActor,
    RolloutService,
    TrainerActor,
    replica_name,
)
from cluster.actors.controller_actor import HANG_TRAINER_AT_ENV
from cluster.actors.replica import KILL_IN_SYNC_ENV
from cluster.actors.trainer_rank import RankGroup, TrainRankActor, hybrid_hosts, rank_name
from models.tiny_config import TinyLMConfig
from cluster.data_builders import dataset_for, prompt_length, response_length, scorer_factory, tokenizer_for
from data.problems import CharTokenizer, Problem, make_problems
from cluster.placement import ReplicaPlacement, place, release_placement
from data.types import SamplingSpec
from config import TidalConfig
from loop.plans import RunSizes
from loop.workload import replica_costs


def tokenizer_and_problems(cfg: TidalConfig) -> tuple[Any, list[Problem]]:
    return tokenizer_for(cfg), make_problems(cfg.task.name, cfg.task.num_prompts, cfg.task.seed)


def model_config(cfg: TidalConfig, tokenizer: CharTokenizer) -> TinyLMConfig:
    m = cfg.model
    return TinyLMConfig(tokenizer.vocab_size, m.n_layer, m.n_head, m.n_embd, m.max_seq_len)


def requests_per_replica(cfg: TidalConfig) -> int:
    """A replica serves up to ``concurrent_samples_per_replica`` samples of ``n`` responses each."""
    return cfg.async_training.concurrent_samples_per_replica * cfg.actor_rollout_ref.rollout.n


def _torch_engine(model_cfg: TinyLMConfig, max_batch: int, device: str, threads: int, eos: int, seed: int,
                  start_asleep: bool = False) -> Any:
    from cluster.engines.torch_engine import TorchEngine

    return TorchEngine(model_cfg, max_batch=max_batch, device="cpu" if device == "auto" else device,
                       threads=threads, eos_id=eos, seed=seed, start_asleep=start_asleep)


@dataclass(frozen=True)
class HFModelSpec:
    """What a replica needs to load a Hugging Face model folder: plain values, picklable."""

    path: str
    tokenizer_path: str
    custom_chat_template: str | None = None
    trust_remote_code: bool = False
    dtype: str = "float32"


def hf_model_spec(cfg: TidalConfig) -> HFModelSpec | None:
    """The HF model of ``cfg``; None when it runs the built-in tiny LM."""
    m = cfg.actor_rollout_ref.model
    if m.path is None:
        return None
    return HFModelSpec(m.path, m.tokenizer_folder, m.custom_chat_template, m.trust_remote_code,
                       cfg.actor_rollout_ref.rollout.dtype)


def _hf_torch_engine(spec: HFModelSpec, max_batch: int, device: str, threads: int, seed: int,
                     start_asleep: bool = False) -> Any:
    """The torch engine serving ``spec``'s folder: EOS ids from its tokenizer and generation config."""
    from cluster.engines.hf_runner import HFRunner
    from cluster.engines.torch_engine import TorchEngine
    from models.hf import eos_ids, load_model, load_tokenizer

    device = "cpu" if device == "auto" else device
    tokenizer = load_tokenizer(spec.tokenizer_path, custom_chat_template=spec.custom_chat_template,
                               trust_remote_code=spec.trust_remote_code)
    model = load_model(spec.path, dtype=spec.dtype, trust_remote_code=spec.trust_remote_code, device=device)
    ids = eos_ids(model, tokenizer)
    if not ids:
        raise ValueError(f"{spec.tokenizer_path}: the tokenizer names no EOS token (eos_token) and the model no eos_token_id")
    eos, *extra = ids
    return TorchEngine(HFRunner(model, device=device), max_batch=max_batch, device=device, threads=threads,
                       eos_id=eos, seed=seed, extra_eos_ids=extra, detokenize=tokenizer.decode,
                       start_asleep=start_asleep)


@dataclass(frozen=True)
class VLLMOptions:
    """A vLLM replica's engine options: TP size, its share of each GPU, and (a hybrid's) sleep level."""

    tp: int = 1
    gpu_memory_utilization: float | None = None
    sleep_level: int = 2
    start_asleep: bool = False


def vllm_options(cfg: TidalConfig, *, hybrid: bool) -> VLLMOptions:
    r = cfg.actor_rollout_ref.rollout
    return VLLMOptions(cfg.gpus_per_replica,
                       r.gpu_memory_utilization if hybrid else r.standalone_gpu_memory_utilization,
                       r.hybrid_sleep_level if hybrid else 2, start_asleep=hybrid)


def _vllm_engine(model_cfg: TinyLMConfig, max_batch: int, threads: int, eos: int, seed: int,
                 options: VLLMOptions = VLLMOptions(), **rank_workers: Any) -> Any:
    """``rank_workers``: ``VLLMHost``'s ``rank_workers``/``rank_ident`` for a hybrid whose TP
    workers live in trainer ranks (``TrainRankActor.build_hybrids`` passes them)."""
    # vLLM lives in its own venv (docs/engines.md); importing it here, where the engine is built
    # (inside a Ray actor), keeps every other kind free of it.
    from cluster.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_cfg, max_batch=max_batch, eos_id=eos, seed=seed, threads=threads,
                      tensor_parallel_size=options.tp, gpu_memory_utilization=options.gpu_memory_utilization,
                      sleep_level=options.sleep_level, start_asleep=options.start_asleep, **rank_workers)


def _vllm_hf_engine(spec: HFModelSpec, max_batch: int, threads: int, seed: int, max_model_len: int,
                    options: VLLMOptions = VLLMOptions(), **rank_workers: Any) -> Any:
    """The vLLM engine serving ``spec``'s folder: EOS ids from its tokenizer and generation config."""
    from cluster.engines.vllm_engine import VLLMEngine, hf_model

    served = hf_model(spec.path, tokenizer_path=spec.tokenizer_path, trust_remote_code=spec.trust_remote_code,
                      max_model_len=max_model_len, custom_chat_template=spec.custom_chat_template)
    return VLLMEngine(served, max_batch=max_batch, seed=seed, threads=threads, dtype=spec.dtype,
                      tensor_parallel_size=options.tp, gpu_memory_utilization=options.gpu_memory_utilization,
                      sleep_level=options.sleep_level, start_asleep=options.start_asleep, **rank_workers)


def _simulated_engine(base_s: float, per_seq_s: float, prefill_s_per_token: float, max_batch: int,
                      lengths: dict[str, Any], eos: int, seed: int, vocab: int, costs: dict[str, Any]) -> Any:
    from cluster.engines.base import request_sample_uid
    from cluster.engines.simulated import SimulatedEngine
    from loop.workload import SeededLengths

    return SimulatedEngine(decode_step_s=(base_s, per_seq_s), prefill_s_per_token=prefill_s_per_token,
                           max_batch=max_batch, lengths=SeededLengths(**lengths, seed=seed, prompt_key=request_sample_uid),
                           eos_id=eos, seed=seed, vocab_size=vocab, **costs)


def simulated_engine_costs(cfg: TidalConfig, *, hybrid: bool) -> dict[str, Any]:
    """The switch costs a simulated engine spends, mirroring what the simulator charges per phase.

    Only in a fully emulated cluster (simulated rollout *and* train): with a real trainer the
    syncs move real weights and nothing is modelled. Standalone: ``load_weights`` = the broadcast
    sync, ``resume`` after a pause = the rebalance. Hybrid (starts asleep, like the simulator's):
    ``sleep`` = the deactivation, ``wake_up`` = hybrid sync + activation (the simulator makes a
    hybrid routable ``hybrid_sync_s + activate_s`` after the sync starts; the trainer wakes its
    hybrids concurrently, so the phase takes that long whatever their number).
    """
    if cfg.engines.train != "simulated":
        return {}
    s = cfg.sim
    if hybrid:
        return {"sleep_s": s.deactivate_s, "wake_up_s": s.hybrid_sync_s + s.activate_s, "start_asleep": True}
    return {"load_weights_s": s.broadcast_sync_s, "resume_s": s.rebalance_s}


def engine_factory(cfg: TidalConfig, tokenizer: CharTokenizer, *, hybrid: bool, seed: int) -> Callable[[], Any]:
    """A picklable zero-argument callable that builds one replica's engine where it is called."""
    kind = cfg.engines.rollout
    hf = hf_model_spec(cfg)
    tp = cfg.gpus_per_replica
    if kind == "torch" and hf is not None:
        return functools.partial(_hf_torch_engine, hf, requests_per_replica(cfg), cfg.engines.device,
                                 cfg.engines.torch_threads_per_actor, seed, start_asleep=hybrid)
    if kind == "torch":
        return functools.partial(_torch_engine, model_config(cfg, tokenizer), requests_per_replica(cfg),
                                 cfg.engines.device, cfg.engines.torch_threads_per_actor, tokenizer.eos_id, seed,
                                 start_asleep=hybrid)
    if kind == "vllm" and hf is not None:
        return functools.partial(_vllm_hf_engine, hf, requests_per_replica(cfg), cfg.engines.torch_threads_per_actor,
                                 seed, prompt_length(cfg) + response_length(cfg), vllm_options(cfg, hybrid=hybrid))
    if kind == "vllm":
        return functools.partial(_vllm_engine, model_config(cfg, tokenizer), requests_per_replica(cfg),
                                 cfg.engines.torch_threads_per_actor, tokenizer.eos_id, seed,
                                 vllm_options(cfg, hybrid=hybrid))
    if kind == "simulated":
        # The simulator's replica and workload: up to max_num_seqs running, lengths drifting over
        # the run's steps; one token seed for every replica (a retry elsewhere continues its response).
        s = cfg.sim
        costs = replica_costs(s, hybrid=hybrid)  # the simulator's rule: MTP, hybrid speed and batch cap
        prompts = cfg.rollout.total_rollout_steps or cfg.task.num_prompts * cfg.rollout.total_epochs
        steps = cfg.trainer.total_training_steps or prompts // cfg.step_required_samples  # as the simulator
        lengths = dict(mean_start=s.response_len_mean_start, mean_end=s.response_len_mean_end,
                       response_sigma=s.response_len_sigma, prompt_sigma=s.prompt_len_sigma,
                       max_len=cfg.actor_rollout_ref.rollout.response_length, last_version=max(0, steps - 1))
        return functools.partial(
            _simulated_engine, costs.base_s / costs.speed, costs.per_seq_s / costs.speed,
            1.0 / (s.prefill_tokens_per_s * costs.speed), costs.max_num_seqs, lengths, tokenizer.eos_id,
            cfg.trainer.seed, tokenizer.vocab_size, simulated_engine_costs(cfg, hybrid=hybrid),
        )
    raise ValueError(f"engines.rollout={kind!r} is not available in this build")


def backend_factory(cfg: TidalConfig) -> Callable[[], Any]:
    """A zero-argument callable that builds the train backend where it is called (the trainer
    actor): on the HF folder's model (float32, trained in place) when ``model.path`` is set.
    Imports the backends (and torch) only there, not in the driver that makes it."""

    def make() -> Any:
        from cluster.backends import build_backend

        tokenizer, problems = tokenizer_and_problems(cfg)
        return build_backend(cfg, tokenizer, problems, model=_hf_train_model(cfg))

    return make


def start_ranks(cfg: TidalConfig, namespace: str, scheduling: list[dict[str, Any]],
                hybrid_factories: Mapping[str, Callable[[], Any]] | None = None) -> list[Any]:
    """The trainer's rank actors (none when it has one GPU), named in the run's namespace, each
    where its ``cluster.placement`` options put it, each building the train backend itself and
    the hybrid engines it hosts (``trainer_rank.hybrid_hosts``: a hybrid spans
    ``tensor_model_parallel_size`` ranks and its engine lives on the first; on vLLM each of
    those ranks' processes hosts one of its TP workers)."""
    per_node = cfg.trainer.n_gpus_per_node
    make = backend_factory(cfg)
    factories = dict(hybrid_factories or {})
    hosts = hybrid_hosts(list(factories), len(scheduling), per_node, cfg.gpus_per_replica) if scheduling else {}
    on_rank = {r: {rid: factories[rid] for rid, ranks in hosts.items() if ranks[0] == r} for r in range(len(scheduling))}
    in_ranks = cfg.engines.rollout == "vllm"  # vLLM: one TP worker in each rank's process
    worker_of = {r: rid for rid, ranks in hosts.items() for r in ranks} if in_ranks else {}
    return [TrainRankActor.options(name=rank_name(r), namespace=namespace, lifetime=None, **options).remote(
                r, len(scheduling), r % per_node, make, cfg.engines.device, on_rank[r], worker_of.get(r))
            for r, options in enumerate(scheduling)]


def trainer_backend_factory(cfg: TidalConfig, ranks: list[Any]) -> Callable[[], Any]:
    """What the trainer actor builds its backend with: the backend itself on one GPU, else the
    ``RankGroup`` over ``ranks`` (which forms their process group)."""
    if not ranks:
        return backend_factory(cfg)
    return functools.partial(RankGroup, ranks, setup_timeout_s=cfg.ray.placement.timeout_s)


def _hf_train_model(cfg: TidalConfig) -> Any:
    """The HF causal LM the trainer updates (the folder's weights, float32: the optimizer keeps
    full precision whatever the rollout dtype); None for the built-in tiny LM."""
    m = cfg.actor_rollout_ref.model
    if m.path is None:
        return None
    from cluster.backends.torch_backend import resolve_device
    from models.hf import load_model

    return load_model(m.path, dtype="float32", trust_remote_code=m.trust_remote_code,
                      device=str(resolve_device(cfg.engines.device)))


def policy_factory(cfg: TidalConfig) -> Callable[[], Any]:
    from policies import policy_from_config

    return functools.partial(policy_from_config, cfg)


def sampling_spec(cfg: TidalConfig) -> SamplingSpec:
    r = cfg.actor_rollout_ref.rollout
    return SamplingSpec(max_new_tokens=response_length(cfg), temperature=r.temperature, top_p=r.top_p)


def prompt_budget(cfg: TidalConfig) -> int | None:
    """Prompts the run trains on: `rollout.total_rollout_steps`, capped by the step budget."""
    limit = cfg.rollout.total_rollout_steps
    if cfg.trainer.total_training_steps is not None:
        by_steps = cfg.trainer.total_training_steps * cfg.step_required_samples
        limit = by_steps if limit is None else min(limit, by_steps)
    return limit


def prompts_for(cfg: TidalConfig, consumed: Iterable[tuple[int, int]] = ()) -> list[tuple[int, int, list[int]]]:
    """The run's prompt order (seeded), minus what was already trained on (resume): the training
    dataset's (``data.train_files``, or the built-in task as rows of the same schema)."""
    dataset = dataset_for(cfg, tokenizer_for(cfg))
    assert dataset is not None
    return list(dataset.prompt_stream(epochs=cfg.rollout.total_epochs, skip=consumed, limit=prompt_budget(cfg)))


def run_sizes(cfg: TidalConfig, *, consumed_before: int = 0) -> RunSizes:
    """The run's static sizes the controller's policy context needs; ``consumed_before``: samples
    trained on by earlier processes of the run (they generated as many)."""
    return RunSizes(
        required_samples=cfg.required_samples,
        trigger_parameter_sync_step=cfg.async_training.trigger_parameter_sync_step,
        buffer_samples=cfg.buffer_samples, only_hybrid=cfg.only_hybrid,
        standalone_replicas=cfg.standalone_replicas, hybrid_replicas=cfg.hybrid_replicas,
        consumed_before=consumed_before, generated_before=consumed_before,
        max_required_samples=cfg.max_required_samples, sample_budget=prompt_budget(cfg),
    )


def sync_options(cfg: TidalConfig) -> dict[str, Any]:
    """The controller's weight-sync keywords: the standalones' transport and, for the collective,
    the timeout (the wire dtype and bucket size are the sender's: ``sender_options``)."""
    return dict(transport=cfg.standalone_transport, sync_timeout_s=cfg.actor_rollout_ref.rollout.weight_sync.timeout_s,
                kill_in_sync=os.environ.get(KILL_IN_SYNC_ENV) or None,  # failpoints of the driver's
                hang_trainer_at=os.environ.get(HANG_TRAINER_AT_ENV) or None)


def sender_options(cfg: TidalConfig) -> dict[str, Any]:
    """The trainer's weight-sync keywords: how its hybrids load, and the collective sender's wire
    dtype (the engines') and bucket size, planned into its manifest once, when it is built."""
    rollout = cfg.actor_rollout_ref.rollout
    return dict(hybrid_transport=rollout.weight_sync.hybrid_transport, sync_dtype=rollout.dtype,
                bucket_bytes=rollout.update_weights_bucket_megabytes << 20)


def standalone_ids(cfg: TidalConfig) -> list[str]:
    return [f"standalone-{i}" for i in range(cfg.standalone_replicas)]


def hybrid_ids(cfg: TidalConfig) -> list[str]:
    return [f"hybrid-{i}" for i in range(cfg.hybrid_replicas)]


def start_replica(replica_id: str, make_engine: Callable[[], Any], *, namespace: str,
                  scheduling: Mapping[str, Any]) -> Any:
    """Start one standalone replica actor, named in the run's namespace, where ``scheduling``
    (its ``cluster.placement`` options: GPUs, placement group) puts it; it lives as long as the
    process that started it (the driver, or the rollout service for a replacement)."""
    return ReplicaActor.options(name=replica_name(replica_id), namespace=namespace, lifetime=None,
                                **scheduling).remote(replica_id, make_engine)


@dataclass
class ReplicaStarter:
    """Starts the actors of one standalone slot: its first (``DataPlane.build``) and, called by the
    rollout service, each replacement, with the slot's engine, where ``placement`` puts it: a
    replacement is kept off a node that is lost but not yet declared dead
    (``ReplicaPlacement.for_replacement``), so it never waits on a node that will not run it."""

    make_engine: Callable[[], Any]
    namespace: str
    placement: ReplicaPlacement
    started: int = 0

    def __call__(self, replica_id: str) -> Any:
        options = self.placement.for_replacement(replica_id) if self.started else self.placement.options
        self.started += 1
        return start_replica(replica_id, self.make_engine, namespace=self.namespace, scheduling=options)


def _kill_leftovers(namespace: str, standalone: Iterable[str]) -> None:
    """A resumed run reuses its namespace: end actors a killed driver may have left behind
    (replacement replicas included: every ``replica:*`` actor of the namespace)."""
    names = {CONTROLLER, ROLLOUT_SERVICE, TRAINER, *(replica_name(r) for r in standalone)}
    names.update(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == namespace and a["name"].startswith((replica_name(""), rank_name(0)[:-1])))
    killed = []
    for name in sorted(names):
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
            killed.append(name)
        except ValueError:  # no such actor: the usual case
            continue
    for _ in range(100):  # names are freed asynchronously
        killed = [name for name in killed if _named(name, namespace)]
        if not killed:
            return
        time.sleep(0.1)


def _named(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


@dataclass
class DataPlane:
    """Handles to one run's actors (all named inside ``namespace``)."""

    namespace: str
    trainer: Any
    rollout: Any
    controller: Any
    standalone: dict[str, Any]
    ranks: list[Any] = field(default_factory=list)
    """The trainer's rank actors (empty when it has one GPU); only the process that built them."""

    @classmethod
    def build(cls, cfg: TidalConfig, namespace: str, *, consumed: Iterable[tuple[int, int]] = (),
              param_version: int = 0, replacement_state: Mapping[str, Any] | None = None) -> DataPlane:
        """Start every actor of a run; the rollout service is built but not yet started.
        ``consumed``: the prompts trained on before (a resume); ``replacement_state``: the
        replacer's state at the step a resume starts from."""
        consumed = list(consumed)
        _kill_leftovers(namespace, standalone_ids(cfg))
        tokenizer, _ = tokenizer_and_problems(cfg)
        placement = place(cfg, namespace, standalone_ids(cfg))
        seed = cfg.trainer.seed
        hyb = hybrid_ids(cfg)
        opts = dict(namespace=namespace, lifetime=None)
        hybrid_factories = {rid: engine_factory(cfg, tokenizer, hybrid=True, seed=seed * 1000 + 500 + i)
                            for i, rid in enumerate(hyb)}
        ranks = start_ranks(cfg, namespace, placement.trainer_ranks, hybrid_factories)
        trainer = TrainerActor.options(name=TRAINER, **placement.trainer, **opts).remote(
            trainer_backend_factory(cfg, ranks), hybrid_factories,
            namespace=namespace,
            required_samples=cfg.required_samples,
            **sender_options(cfg),
        )
        # one starter per standalone slot; a replacement is started with its slot's engine
        starters = {
            rid: ReplicaStarter(engine_factory(cfg, tokenizer, hybrid=False, seed=seed * 1000 + i), namespace,
                                placement.slot(rid))
            for i, rid in enumerate(standalone_ids(cfg))
        }
        standalone = {rid: start(rid) for rid, start in starters.items()}
        a, r = cfg.async_training, cfg.rollout
        rollout = RolloutService.options(name=ROLLOUT_SERVICE, **placement.control, **opts).remote(
            standalone=standalone, trainer=trainer, hybrid_ids=hyb,
            max_required_samples=cfg.max_required_samples,
            concurrent_samples_per_replica=a.concurrent_samples_per_replica,
            n=cfg.actor_rollout_ref.rollout.n, sampling=sampling_spec(cfg),
            partial_rollout=a.partial_rollout, seed=seed, param_version=param_version,
            namespace=namespace, replica_starters=starters if r.replace_failed_replicas else None,
            max_replacements=r.max_replacements, replacement_timeout_s=r.replacement_timeout_s,
            replacement_state=replacement_state,
            scorer_factory=None if cfg.engines.rollout == "simulated" else scorer_factory(cfg),
            hybrid_handles=ray.get(trainer.hybrid_handles.remote()),
            heartbeat_timeout_s=r.heartbeat_timeout_s,
        )
        ray.get([trainer.ping.remote(), rollout.ping.remote(), *(h.ping.remote() for h in standalone.values())])
        controller = ControllerActor.options(name=CONTROLLER, **placement.control, **opts).remote(
            policy_factory(cfg), namespace=namespace, standalone_ids=list(standalone), hybrid_ids=hyb,
            enable_rebalance=a.dynamic_schedule_enable_rebalance, only_hybrid=cfg.only_hybrid,
            rebalance_timeout_s=a.dynamic_schedule_rebalance_timeout_s, sizes=run_sizes(cfg, consumed_before=len(consumed)), keep_broadcast_weights=r.replace_failed_replicas and cfg.standalone_transport == "object_store",
            switch_timeout_s=a.switch_call_timeout_s, **sync_options(cfg),
        )
        ray.get(controller.ping.remote())
        return cls(namespace, trainer, rollout, controller, standalone, ranks)

    @classmethod
    def attach(cls, namespace: str, standalone: Iterable[str] = ()) -> DataPlane:
        get = functools.partial(ray.get_actor, namespace=namespace)
        return cls(namespace, get(TRAINER), get(ROLLOUT_SERVICE), get(CONTROLLER),
                   {rid: get(replica_name(rid)) for rid in standalone})

    def current_standalone(self) -> dict[str, Any]:
        """Every standalone actor of the run: the ones built here plus replacements."""
        try:
            return {**self.standalone, **ray.get(self.rollout.standalone_handles.remote(), timeout=30)}
        except Exception:  # noqa: BLE001 - the service is gone: its replacements went with it
            return dict(self.standalone)

    def shutdown(self) -> None:
        """Stop generation and end this run's actors (only these, replacements included)."""
        try:
            ray.get(self.rollout.stop.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        standalone = self.current_standalone()
        for handle in (self.trainer, *standalone.values()):
            try:  # engines first: vLLM's worker processes must not outlive their actor
                ray.get(handle.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                pass
        for handle in (self.controller, self.rollout, self.trainer, *self.ranks, *standalone.values()):
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        release_placement(self.namespace)
