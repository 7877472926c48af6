"""Where a run's actors go on the Ray cluster, checked before any of them is created.

Owns: reading the cluster's nodes (role label, ``tidal_gpu`` count), the capacity check that turns
a cluster too small for the config into one line (exit 2) instead of an actor that waits forever,
the placement groups of the trainer and of each standalone replica (with a bounded wait), and the
scheduling arguments ``cluster/builders.py`` passes to ``.options(...)``.
Must not: build engines or actors, or read more of the config than its sizes and ``ray.placement``.

Two modes, chosen by the cluster:

- **Labelled** (some alive node carries ``ray.placement.role_label``): the trainer gets one
  placement group of ``trainer.nnodes`` bundles of ``trainer.n_gpus_per_node`` GPUs, one bundle
  per trainer node (``STRICT_SPREAD``); its actor, and so its hybrid replicas, run in the first
  bundle, the others hold the GPUs of its other nodes. Each standalone replica gets a group of
  ``tensor_model_parallel_size`` one-GPU bundles packed on one rollout node (``STRICT_PACK``); its
  actor runs in the first. The control actors (rollout service, controller) go on the driver's
  node (the head, normally), never on a rollout node that may be taken away.
- **Unlabelled** (a local one-node cluster, or any cluster without the label): as before, each
  actor asks for its ``tidal_gpu`` count and Ray places it; no placement group.
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


@dataclass(frozen=True)
class NodeView:
    """One alive node as placement sees it."""

    node_id: str
    role: str | None
    gpus: float


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


def nodes_of(ray_nodes: Iterable[Mapping[str, Any]], role_label: str) -> list[NodeView]:
    """The alive nodes of ``ray.nodes()`` with their role label and total ``tidal_gpu``."""
    return [NodeView(str(n["NodeID"]), (n.get("Labels") or {}).get(role_label),
                     float((n.get("Resources") or {}).get(GPU_RESOURCE, 0.0)))
            for n in ray_nodes if n.get("Alive")]


def labelled(nodes: Sequence[NodeView], keys: PlacementSection) -> bool:
    """Whether the cluster names node roles (then placement follows them)."""
    return any(n.role in (keys.trainer_role, keys.rollout_role) for n in nodes)


def _role_shortfall(nodes: Sequence[NodeView], keys: PlacementSection, role: str, count: int,
                    per_node: int) -> str | None:
    if count == 0:
        return None
    with_role = [n for n in nodes if n.role == role]
    fit = [n for n in with_role if n.gpus >= per_node]
    if len(fit) >= count:
        return None
    small = f", {len(with_role) - len(fit)} of them with fewer {GPU_RESOURCE}" if len(fit) < len(with_role) else ""
    return (f"{count} {role} node(s) (label {keys.role_label}={role}) with {per_node} {GPU_RESOURCE} each, "
            f"found {len(with_role)}{small}")


def _first_fit_shortfall(nodes: Sequence[NodeView], demand: Demand) -> str | None:
    """Unlabelled: the trainer's GPUs on one node, then each replica's on one node, first fit."""
    free = sorted((n.gpus for n in nodes), reverse=True)
    total = sum(free)
    asks = [("the trainer", demand.trainer_gpus)] + [
        (f"standalone replica {i}", demand.gpus_per_replica) for i in range(demand.standalone_replicas)]
    for who, gpus in asks:
        slot = next((k for k, room in enumerate(free) if room >= gpus), None)
        if slot is None:
            need = demand.trainer_gpus + demand.standalone_replicas * demand.gpus_per_replica
            return (f"{need:g} {GPU_RESOURCE} ({demand.trainer_gpus} for the trainer, {demand.gpus_per_replica} per "
                    f"standalone replica, each on one node); found {total:g} on {len(nodes)} node(s), no room left "
                    f"for {who}'s {gpus}")
        free[slot] -= gpus
    return None


def shortfall(demand: Demand, nodes: Sequence[NodeView], keys: PlacementSection) -> str | None:
    """What the cluster lacks for ``demand`` (one line), or None when it fits."""
    if not labelled(nodes, keys):
        return _first_fit_shortfall(nodes, demand)
    missing = [m for m in (
        _role_shortfall(nodes, keys, keys.trainer_role, demand.trainer_nodes, demand.trainer_gpus_per_node),
        _role_shortfall(nodes, keys, keys.rollout_role, demand.rollout_nodes, demand.rollout_gpus_per_node),
    ) if m]
    if demand.rollout_nodes and demand.rollout_gpus_per_node % demand.gpus_per_replica:
        missing.append(f"rollout.n_gpus_per_node={demand.rollout_gpus_per_node} holding whole replicas of "
                       f"tensor_model_parallel_size={demand.gpus_per_replica}")
    return "; ".join(missing) or None


@dataclass
class Placement:
    """The ``.options(...)`` scheduling arguments of one run's actors, and the groups it holds."""

    trainer: dict[str, Any]
    control: dict[str, Any]
    replicas: dict[str, dict[str, Any]]
    groups: list[Any] = field(default_factory=list)

    def replica(self, replica_id: str) -> dict[str, Any]:
        return self.replicas[replica_id]

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


def _in_bundle(group: Any, index: int, resources: Mapping[str, float]) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # num_cpus=0: the bundle holds GPUs only; an actor's default CPU would not fit in it
    return dict(num_cpus=0, resources=dict(resources),
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index))


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
    if not labelled(nodes, keys):
        return Placement(trainer=dict(resources={GPU_RESOURCE: cfg.trainer_gpus}), control={},
                         replicas={rid: dict(resources={GPU_RESOURCE: demand.gpus_per_replica}) for rid in replica_ids})
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    on = {keys.role_label: keys.trainer_role}
    trainer_pg = placement_group([{GPU_RESOURCE: demand.trainer_gpus_per_node}] * demand.trainer_nodes,
                                 strategy="STRICT_SPREAD", bundle_label_selector=[on] * demand.trainer_nodes,
                                 name=f"{namespace}:trainer")
    on = {keys.role_label: keys.rollout_role}
    tp = demand.gpus_per_replica
    replica_pgs = {rid: placement_group([{GPU_RESOURCE: 1}] * tp, strategy="STRICT_PACK",
                                        bundle_label_selector=[on] * tp, name=f"{namespace}:{rid}")
                   for rid in replica_ids}
    groups = [trainer_pg, *replica_pgs.values()]
    held = Placement(
        trainer=_in_bundle(trainer_pg, 0, {GPU_RESOURCE: demand.trainer_gpus_per_node}),
        # the driver's node: alive as long as the run; no CPU asked, so a busy head still takes them
        control=dict(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)),
        replicas={rid: _in_bundle(pg, 0, {GPU_RESOURCE: 1}) for rid, pg in replica_pgs.items()},
        groups=groups,
    )
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
    """Give back the placement groups of the run ``namespace`` (nothing when it holds none)."""
    held = _HELD.pop(namespace, None)
    if held is not None:
        held.release()
