"""Where a run's actors go on the Ray cluster, checked before any of them is created.

Owns: reading the cluster's nodes (role label, accelerator counts), which accelerator resource the
run asks for, the capacity check that turns a cluster too small for the config into one line
(exit 2) instead of an actor that waits forever, the placement groups of the trainer and of each
standalone replica (with a bounded wait), and the scheduling arguments ``cluster/builders.py``
passes to ``.options(...)``.
Must not: build engines or actors, or read more of the config than its sizes and ``ray.placement``.

The accelerator: Ray's own ``GPU`` when some alive node advertises it (a GPU cluster: actors ask
``num_gpus``, so Ray sets ``CUDA_VISIBLE_DEVICES`` and ``ray.get_gpu_ids()``), else the emulated
``tidal_gpu`` (CPU emulation only). Whatever asks one asks the same resource, capacity check
included.

The trainer is N = ``trainer.nnodes × trainer.n_gpus_per_node`` rank actors, one accelerator
each, rank r on trainer node r // n_gpus_per_node (``Placement.trainer_ranks``), and the trainer
actor, a façade that asks for nothing and runs on trainer node 0 (``Placement.trainer``). With
N == 1 there are no rank actors: the trainer actor holds the accelerator itself.

Two modes, chosen by the cluster:

- **Labelled** (some alive node carries ``ray.placement.role_label``): the trainer gets one
  placement group of ``trainer.nnodes`` bundles of ``trainer.n_gpus_per_node`` accelerators, one
  bundle per trainer node (``STRICT_SPREAD``); its actor, and so its hybrid replicas, run in the
  first bundle, the ranks of node k in bundle k. Each standalone replica gets a group of
  ``tensor_model_parallel_size`` one-accelerator bundles packed on one rollout node
  (``STRICT_PACK``); its actor runs in the first. The control actors (rollout service,
  controller) go on the driver's node (the head, normally), never on a rollout node that may be
  taken away.
- **Unlabelled** (a local one-node cluster, or any cluster without the label): each standalone
  replica asks for its accelerator count and Ray places it, no placement group. A one-rank trainer
  does the same; a trainer of N > 1 ranks gets the same per-node bundles as above, ``PACK`` (one
  node if it has the room, else spread).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.ray_cluster import GPU_RESOURCE
from config import ConfigError, TidalConfig
from config.placement_keys import PlacementSection


class ClusterTooSmall(ConfigError):
    """The Ray cluster cannot host the config's actors; ``str()`` is one line saying what is missing."""


RAY_GPU = "GPU"
"""Ray's own accelerator resource (``num_gpus``)."""


@dataclass(frozen=True)
class NodeView:
    """One alive node as placement sees it: its role and both accelerator counts."""

    node_id: str
    role: str | None
    gpus: float
    """Emulated ``tidal_gpu``."""
    ray_gpus: float = 0.0
    """Ray's own ``GPU``."""

    def accelerators(self, accelerator: str) -> float:
        return self.ray_gpus if accelerator == RAY_GPU else self.gpus


@dataclass(frozen=True)
class Demand:
    """What a config asks of the cluster: nodes per role, GPUs per node, GPUs per replica."""

    trainer_nodes: int
    trainer_gpus_per_node: int
    rollout_nodes: int
    rollout_gpus_per_node: int
    gpus_per_replica: int

    @classmethod
    def of(cls, cfg: TidalConfig) -> Demand:
        return cls(cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.rollout.nnodes,
                   cfg.rollout.n_gpus_per_node, cfg.gpus_per_replica)

    @property
    def trainer_gpus(self) -> int:
        return self.trainer_nodes * self.trainer_gpus_per_node

    @property
    def standalone_replicas(self) -> int:
        return self.rollout_nodes * self.rollout_gpus_per_node // self.gpus_per_replica

    @property
    def trainer_ranks(self) -> int:
        """Rank actors of the trainer: one per accelerator, none when it has one (the trainer
        actor holds it)."""
        return self.trainer_gpus if self.trainer_gpus > 1 else 0


def nodes_of(ray_nodes: Iterable[Mapping[str, Any]], role_label: str) -> list[NodeView]:
    """The alive nodes of ``ray.nodes()`` with their role label, total ``tidal_gpu`` and ``GPU``."""
    return [NodeView(str(n["NodeID"]), (n.get("Labels") or {}).get(role_label),
                     float((n.get("Resources") or {}).get(GPU_RESOURCE, 0.0)),
                     float((n.get("Resources") or {}).get(RAY_GPU, 0.0)))
            for n in ray_nodes if n.get("Alive")]


def accelerator_of(nodes: Sequence[NodeView]) -> str:
    """The resource a run asks for one accelerator: Ray's ``GPU`` when some node advertises it,
    else the emulated ``tidal_gpu``."""
    return RAY_GPU if any(n.ray_gpus > 0 for n in nodes) else GPU_RESOURCE


def asking(accelerator: str, count: float) -> dict[str, Any]:
    """The ``.options(...)`` arguments asking for ``count`` of ``accelerator`` (none for 0)."""
    if not count:
        return {}
    return dict(num_gpus=count) if accelerator == RAY_GPU else dict(resources={GPU_RESOURCE: count})


def labelled(nodes: Sequence[NodeView], keys: PlacementSection) -> bool:
    """Whether the cluster names node roles (then placement follows them)."""
    return any(n.role in (keys.trainer_role, keys.rollout_role) for n in nodes)


def _role_shortfall(nodes: Sequence[NodeView], keys: PlacementSection, accelerator: str, role: str, count: int,
                    per_node: int) -> str | None:
    if count == 0:
        return None
    with_role = [n for n in nodes if n.role == role]
    fit = [n for n in with_role if n.accelerators(accelerator) >= per_node]
    if len(fit) >= count:
        return None
    small = f", {len(with_role) - len(fit)} of them with fewer {accelerator}" if len(fit) < len(with_role) else ""
    return (f"{count} {role} node(s) (label {keys.role_label}={role}) with {per_node} {accelerator} each, "
            f"found {len(with_role)}{small}")


def _first_fit_shortfall(nodes: Sequence[NodeView], demand: Demand, accelerator: str) -> str | None:
    """Unlabelled: each trainer node's accelerators on one node, then each replica's on one node,
    first fit."""
    free = sorted((n.accelerators(accelerator) for n in nodes), reverse=True)
    total = sum(free)
    per_node, trainer_nodes = demand.trainer_gpus_per_node, demand.trainer_nodes
    trainer = ([("the trainer", per_node)] if trainer_nodes == 1
               else [(f"trainer node {k}", per_node) for k in range(trainer_nodes)])
    asks = trainer + [(f"standalone replica {i}", demand.gpus_per_replica) for i in range(demand.standalone_replicas)]
    for who, gpus in asks:
        slot = next((k for k, room in enumerate(free) if room >= gpus), None)
        if slot is None:
            need = demand.trainer_gpus + demand.standalone_replicas * demand.gpus_per_replica
            blocks = f" as {trainer_nodes} nodes of {per_node}" if trainer_nodes > 1 else ""
            return (f"{need:g} {accelerator} ({demand.trainer_gpus} for the trainer{blocks}, {demand.gpus_per_replica} "
                    f"per standalone replica, each on one node); found {total:g} on {len(nodes)} node(s), no room "
                    f"left for {who}'s {gpus}")
        free[slot] -= gpus
    return None


def shortfall(demand: Demand, nodes: Sequence[NodeView], keys: PlacementSection) -> str | None:
    """What the cluster lacks for ``demand`` (one line), or None when it fits. Counted in the
    cluster's accelerator (``accelerator_of``)."""
    accelerator = accelerator_of(nodes)
    if not labelled(nodes, keys):
        return _first_fit_shortfall(nodes, demand, accelerator)
    missing = [m for m in (
        _role_shortfall(nodes, keys, accelerator, keys.trainer_role, demand.trainer_nodes,
                        demand.trainer_gpus_per_node),
        _role_shortfall(nodes, keys, accelerator, keys.rollout_role, demand.rollout_nodes,
                        demand.rollout_gpus_per_node),
    ) if m]
    if demand.rollout_nodes and demand.rollout_gpus_per_node % demand.gpus_per_replica:
        missing.append(f"rollout.n_gpus_per_node={demand.rollout_gpus_per_node} holding whole replicas of "
                       f"tensor_model_parallel_size={demand.gpus_per_replica}")
    return "; ".join(missing) or None


NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives every node: its node id (a label selector keeps an actor off nodes by it)."""
RAYLET_PROBE_S = 1.0
"""How long a node's raylet has to accept a TCP connection before the node counts as lost."""


def unreachable_nodes(candidates: Iterable[Mapping[str, Any]] | None = None,
                      timeout_s: float = RAYLET_PROBE_S) -> set[str]:
    """The ids of the nodes the head still lists alive but whose raylet does not accept a TCP
    connection within ``timeout_s`` (refused: its processes are gone; no answer: its machine is).
    The head declares such a node dead only after its health check has failed for a while
    (``RAY_health_check_*``: 15-30 s by default); until then Ray still places actors and bundles
    there, and they wait for a node that will never run them. ``candidates``: entries of
    ``ray.nodes()`` (all of them when None). Probed in parallel: at most ``timeout_s`` in all."""
    import socket
    from concurrent.futures import ThreadPoolExecutor

    import ray

    nodes = [n for n in (ray.nodes() if candidates is None else candidates) if n.get("Alive")]

    def down(node: Mapping[str, Any]) -> bool:
        try:
            with socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])), timeout=timeout_s):
                return False
        except (OSError, KeyError, ValueError, TypeError):
            return True

    if not nodes:
        return set()
    with ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="raylet-probe") as pool:
        lost = list(pool.map(down, nodes))
    return {str(n["NodeID"]) for n, gone in zip(nodes, lost, strict=True) if gone}


def _not_on(node_ids: Iterable[str]) -> str:
    return f"!in({','.join(sorted(node_ids))})"


@dataclass
class ReplicaPlacement:
    """Where the actors of one standalone slot go: the ``.options(...)`` of its first actor, and,
    for each replacement (``for_replacement``), the same unless a node it would be placed on is lost
    but not yet declared dead (``unreachable_nodes``). Then the replacement is kept off every such
    node: labelled, the slot's placement group (whose bundle sits on the lost node, and would be
    placed again wherever Ray chooses once the node is declared dead) is removed and a new one
    made, on a rollout node other than the lost ones; unlabelled, the actor asks for a node other
    than those by label (``ray.io/node-id``). Picklable: the rollout service holds it in its slot's
    starter (``cluster/builders.py``)."""

    namespace: str
    options: dict[str, Any]
    accelerator: str
    gpus: int
    selector: dict[str, str] | None = None
    """The bundles' label selector (the rollout role); None: unlabelled, no placement group."""
    avoided: set[str] = field(default_factory=set)

    def _group(self) -> Any:
        strategy = self.options.get("scheduling_strategy")
        return getattr(strategy, "placement_group", None)

    def for_replacement(self, replica_id: str, probe_timeout_s: float = RAYLET_PROBE_S) -> dict[str, Any]:
        """The ``.options(...)`` of the actor replacing this slot's last one, ``replica_id``."""
        import logging

        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        group = self._group()
        if group is None and self.selector is not None:
            return self.options
        lost = unreachable_nodes(timeout_s=probe_timeout_s) - self.avoided
        if not lost:
            return self.options
        log = logging.getLogger(__name__)
        if group is None:  # unlabelled: the actor asks for any node but the lost ones
            self.avoided |= lost
            self.options = {**self.options, "label_selector": {NODE_ID_LABEL: _not_on(self.avoided)}}
            log.warning("%s: node(s) %s lost (raylet unreachable): placed elsewhere", replica_id, sorted(lost))
            return self.options
        where = set(placement_group_table(group).get("bundles_to_node_id", {}).values())
        if not where & lost:
            return self.options
        self.avoided |= lost
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - already gone with its job
            pass
        selector = {**self.selector, NODE_ID_LABEL: _not_on(self.avoided)}
        new = placement_group([{self.accelerator: 1} for _ in range(self.gpus)], strategy="STRICT_PACK",
                              bundle_label_selector=[selector] * self.gpus, name=f"{self.namespace}:{replica_id}")
        self.options = _in_bundle(new, 0, self.accelerator, 1)
        log.warning("%s: its placement group's node %s is lost (raylet unreachable): a new group avoids it",
                    replica_id, sorted(where & lost))
        return self.options


@dataclass
class Placement:
    """The ``.options(...)`` scheduling arguments of one run's actors, and the groups it holds.

    ``trainer``: the trainer actor's; with N > 1 ranks it asks for no accelerator and no CPU and
    runs in bundle 0 of the trainer's group (trainer node 0), with N == 1 it holds the one
    accelerator itself. ``trainer_ranks``: each rank actor's, in rank order (one accelerator,
    ``num_cpus=0``, rank r in bundle r // n_gpus_per_node); empty when N == 1."""

    trainer: dict[str, Any]
    control: dict[str, Any]
    replicas: dict[str, dict[str, Any]]
    trainer_ranks: list[dict[str, Any]] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)

    slots: dict[str, ReplicaPlacement] = field(default_factory=dict)
    """Each standalone slot's placement over the run (``ReplicaPlacement``), by its first id."""

    def replica(self, replica_id: str) -> dict[str, Any]:
        return self.replicas[replica_id]

    def slot(self, replica_id: str) -> ReplicaPlacement:
        """The placement of ``replica_id``'s slot, its replacements' included."""
        return self.slots[replica_id]

    def release(self) -> None:
        """Remove this run's placement groups (their GPUs go back to the cluster)."""
        from ray.util import remove_placement_group

        for group in self.groups:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - best effort on the way out (the cluster may be gone)
                pass
        self.groups = []


_HELD: dict[str, Placement] = {}
"""The placement of each run (namespace) this process built, until ``release_placement``."""


def _in_bundle(group: Any, index: int, accelerator: str, count: int) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # num_cpus=0: the bundle holds accelerators only; an actor's default CPU would not fit in it.
    # count 0 (the façade): Ray 2.60 takes an actor that asks for nothing in a bundle and still pins
    # it there (it holds 0.001 of the bundle's own `bundle_group_<index>_<group id>` resource).
    return dict(num_cpus=0, **asking(accelerator, count),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index))


def trainer_bundles(demand: Demand, accelerator: str) -> list[dict[str, float]]:
    """The trainer's placement group: one bundle per trainer node, its accelerators."""
    return [{accelerator: demand.trainer_gpus_per_node} for _ in range(demand.trainer_nodes)]


def replica_bundles(demand: Demand, accelerator: str) -> list[dict[str, float]]:
    """A standalone replica's placement group: one bundle per accelerator."""
    return [{accelerator: 1} for _ in range(demand.gpus_per_replica)]


def scheduling(demand: Demand, accelerator: str, replica_ids: Sequence[str], *, trainer_group: Any = None,
               replica_groups: Mapping[str, Any] | None = None, control: Mapping[str, Any] | None = None,
               namespace: str = "", replica_selector: Mapping[str, str] | None = None) -> Placement:
    """The ``.options(...)`` arguments of every actor of a run: in ``trainer_group`` (bundles of
    ``trainer_bundles``) and ``replica_groups`` (``replica_bundles``) when given, else asked of
    Ray directly. A trainer of N > 1 ranks needs its group. Creates nothing (no Ray call)."""
    ranks = demand.trainer_ranks
    if trainer_group is None:
        if ranks:
            raise ValueError(f"a trainer of {ranks} ranks is placed in its placement group")
        trainer = asking(accelerator, demand.trainer_gpus)
    else:
        trainer = _in_bundle(trainer_group, 0, accelerator, 0 if ranks else demand.trainer_gpus)
    per_node = demand.trainer_gpus_per_node
    replicas = {rid: (_in_bundle(replica_groups[rid], 0, accelerator, 1) if replica_groups
                      else asking(accelerator, demand.gpus_per_replica)) for rid in replica_ids}
    selector = dict(replica_selector) if replica_groups and replica_selector else None
    return Placement(
        trainer=trainer,
        control=dict(control or {}),
        replicas=replicas,
        trainer_ranks=[_in_bundle(trainer_group, r // per_node, accelerator, 1) for r in range(ranks)],
        slots={rid: ReplicaPlacement(namespace, replicas[rid], accelerator, demand.gpus_per_replica, selector)
               for rid in replica_ids},
    )


def place(cfg: TidalConfig, namespace: str, replica_ids: Sequence[str]) -> Placement:
    """Check the cluster against ``cfg`` and reserve what the run's actors need; raises
    ``ClusterTooSmall`` (one line) when it cannot, within ``ray.placement.timeout_s``."""
    import ray

    release_placement(namespace)  # a resume in the same process builds its actors again
    keys = cfg.ray.placement
    demand = Demand.of(cfg)
    nodes = nodes_of(ray.nodes(), keys.role_label)
    where = f"the Ray cluster at {ray.get_runtime_context().gcs_address}"
    problem = shortfall(demand, nodes, keys)
    if problem:  # the CLI checked before the run started (check_cluster); the cluster changed since
        raise ClusterTooSmall(f"{where} is too small for this config: it needs {problem}")
    accelerator = accelerator_of(nodes)
    from ray.util.placement_group import placement_group

    if not labelled(nodes, keys):
        if not demand.trainer_ranks:  # nothing held: Ray places each actor
            return scheduling(demand, accelerator, replica_ids, namespace=namespace)
        # PACK, soft: the ranks on as few nodes as have the room (one local node), else spread
        trainer_pg = placement_group(trainer_bundles(demand, accelerator), strategy="PACK",
                                     name=f"{namespace}:trainer")
        held = scheduling(demand, accelerator, replica_ids, trainer_group=trainer_pg, namespace=namespace)
        held.groups = [trainer_pg]
        _wait_placed(held, ["the trainer"], keys.timeout_s, where)
        _HELD[namespace] = held
        return held
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    on = {keys.role_label: keys.trainer_role}
    trainer_pg = placement_group(trainer_bundles(demand, accelerator), strategy="STRICT_SPREAD",
                                 bundle_label_selector=[on] * demand.trainer_nodes, name=f"{namespace}:trainer")
    on = {keys.role_label: keys.rollout_role}
    tp = demand.gpus_per_replica
    replica_pgs = {rid: placement_group(replica_bundles(demand, accelerator), strategy="STRICT_PACK",
                                        bundle_label_selector=[on] * tp, name=f"{namespace}:{rid}")
                   for rid in replica_ids}
    held = scheduling(
        demand, accelerator, replica_ids, trainer_group=trainer_pg, replica_groups=replica_pgs,
        # the driver's node: alive as long as the run; no CPU asked, so a busy head still takes them
        control=dict(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)),
        namespace=namespace, replica_selector=on,
    )
    held.groups = [trainer_pg, *replica_pgs.values()]
    _wait_placed(held, ["the trainer", *replica_ids], keys.timeout_s, where)
    _HELD[namespace] = held
    return held


def check_cluster(cfg: TidalConfig) -> None:
    """Before a run starts (the CLI calls this, ahead of any flow run or store row): attach to
    ``ray.address`` and raise ``ClusterTooSmall`` when it cannot host ``cfg``. Nothing to check for
    a local cluster: the run sizes the one it starts."""
    if not cfg.ray.address:
        return
    import ray

    from cluster.ray_cluster import init_ray

    attached = ray.is_initialized()
    try:
        init_ray(address=cfg.ray.address, num_cpus=None, gpus=0, memory_gb=cfg.ray.memory_gb,
                 object_store_memory_gb=cfg.ray.object_store_memory_gb, temp_dir=None, namespace="tidal-check")
    except (ConnectionError, TimeoutError, RuntimeError) as exc:
        raise ClusterTooSmall(f"cannot reach the Ray cluster at ray.address={cfg.ray.address}: {exc}") from None
    try:
        keys = cfg.ray.placement
        problem = shortfall(Demand.of(cfg), nodes_of(ray.nodes(), keys.role_label), keys)
        if problem:
            raise ClusterTooSmall(f"the Ray cluster at {ray.get_runtime_context().gcs_address} is too small "
                                  f"for this config: it needs {problem}")
    finally:
        if not attached:
            ray.shutdown()


def trainer_parameters(cfg: TidalConfig) -> int:
    """The trainer's parameter count: the HF folder's model (built on the meta device) or TinyLM's."""
    import torch

    with torch.device("meta"):
        m = cfg.actor_rollout_ref.model
        if m.path is None:
            from models.model import TinyLM, TinyLMConfig

            from cluster.data_builders import tokenizer_for

            model = TinyLM(TinyLMConfig(tokenizer_for(cfg).vocab_size, cfg.model.n_layer, cfg.model.n_head,
                                        cfg.model.n_embd, cfg.model.max_seq_len))
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(m.path, local_files_only=True, trust_remote_code=m.trust_remote_code)
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def trainer_bytes_while_lent(cfg: TidalConfig, params: int) -> dict[str, float]:
    """Bytes one trainer GPU keeps while its hybrid is lent, by kind: the fp32 parameters (sharded
    by FSDP2 and ZeRO-3, whole under ZeRO 0-2) unless ``fsdp_config.param_offload``, and the
    fp32 gradients and AdamW's two moments (sharded) unless ``optimizer_offload``."""
    ranks = cfg.trainer_gpus
    offload = cfg.actor_rollout_ref.actor.fsdp_config
    sharded_params = cfg.engines.train != "deepspeed" or cfg.engines.deepspeed_zero_stage == 3
    return {"parameters": 0.0 if offload.param_offload else 4.0 * params / (ranks if sharded_params else 1),
            "gradients and AdamW state": 0.0 if offload.optimizer_offload else 12.0 * params / ranks}


def check_hybrid_memory(cfg: TidalConfig) -> None:
    """Raise ``ClusterTooSmall`` (one line) when a hybrid's ``gpu_memory_utilization`` of a GPU of
    ``trainer.gpu_memory_gb`` does not fit beside what the trainer keeps there while lent. Nothing
    to check without hybrids, off vLLM (the torch engine takes what it needs) or without the size."""
    memory_gb = cfg.trainer.gpu_memory_gb
    if not cfg.hybrid_replicas or cfg.engines.rollout != "vllm" or memory_gb is None:
        return
    kept = trainer_bytes_while_lent(cfg, trainer_parameters(cfg))
    kept_gb = sum(kept.values()) / 1e9
    share = cfg.actor_rollout_ref.rollout.gpu_memory_utilization
    if share * memory_gb + kept_gb <= memory_gb:
        return
    what = " + ".join(f"{name} {b / 1e9:.3g} GB" for name, b in kept.items() if b)
    offload = "actor_rollout_ref.actor.fsdp_config.param_offload / optimizer_offload"
    if kept_gb >= memory_gb:
        raise ClusterTooSmall(f"the trainer alone keeps {what} on a {memory_gb:g} GB trainer GPU while lent: no room "
                              f"for a hybrid; offload more ({offload}) or use more trainer GPUs")
    fits = 1.0 - kept_gb / memory_gb
    raise ClusterTooSmall(
        f"a hybrid asks actor_rollout_ref.rollout.gpu_memory_utilization={share:g} of a {memory_gb:g} GB trainer GPU "
        f"({share * memory_gb:.3g} GB), but the trainer keeps {what} on it while lent, leaving {memory_gb - kept_gb:.3g} GB: "
        f"lower it to {fits:.2f} or less, or offload more ({offload})")


def _wait_placed(held: Placement, names: Sequence[str], timeout_s: float, where: str) -> None:
    import ray

    ready = [group.ready() for group in held.groups]
    done, _ = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
    if len(done) == len(ready):
        return
    waiting = [name for name, ref in zip(names, ready, strict=True) if ref not in done]
    held.release()
    raise ClusterTooSmall(f"{where} did not place the placement groups of {', '.join(waiting)} within "
                          f"{timeout_s:g}s (ray.placement.timeout_s): their nodes are missing, full or unlabelled")


def release_placement(namespace: str) -> None:
    """Give back the placement groups of the run ``namespace`` (nothing when it holds none), and
    the ones made for its replacements (``ReplicaPlacement``: by the rollout service, named
    ``NAMESPACE:ID``) while this process held the run's."""
    held = _HELD.pop(namespace, None)
    if held is None:
        return
    held.release()
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    try:
        table = placement_group_table()
    except Exception:  # noqa: BLE001 - the cluster is gone: so are its groups
        return
    for group_id, info in table.items():
        if str(info.get("name", "")).startswith(f"{namespace}:") and info.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
