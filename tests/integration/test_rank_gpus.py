"""The trainer's rank actors on a real local Ray cluster, placed by ``cluster/placement.py``: on a
cluster that advertises Ray's own ``GPU`` (two, none real) each rank gets a GPU of its own from
Ray (``ray.get_gpu_ids()``, ``CUDA_VISIBLE_DEVICES``); on an emulated one (``tidal_gpu``) each
holds one ``tidal_gpu``; on a labelled cluster of two one-GPU trainer nodes each rank runs on the
node of its bundle. The trainer actor (the façade) holds nothing, in bundle 0 of the trainer's
group. Ray's resource accounting is read at each stage, and the group is given back."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import ray
from driver_support import attached_to

from cluster.placement import place, release_placement
from cluster.ray_cluster import LocalMultiNodeCluster, LocalRayCluster, NodeSpec
from config import load_config

pytestmark = pytest.mark.slow

NAMESPACE = "rank-gpus"
OVERRIDES = ["trainer.n_gpus_per_node=2", "rollout.nnodes=0"]  # N = 2 ranks on one node, only hybrid


@contextmanager
def _attached(cluster: LocalRayCluster | LocalMultiNodeCluster) -> Iterator[None]:
    """``driver_support.attached_to``, giving back this module's placement groups first."""
    with attached_to(cluster):
        try:
            yield
        finally:
            release_placement(NAMESPACE)


def _probe_class() -> Any:
    """A tiny actor reporting what Ray gave it (defined here, so Ray ships it by value)."""

    @ray.remote
    class Probe:
        def devices(self) -> tuple[list[Any], str | None, dict[str, float]]:
            return (ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"),
                    dict(ray.get_runtime_context().get_assigned_resources()))

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    return Probe


def _settled(resource: str, want: float, timeout_s: float = 30.0) -> float:
    """The cluster's free ``resource`` once it reads ``want`` (Ray's view lags a little), or the
    last value read when it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        free = ray.available_resources().get(resource, 0.0)
        if free == pytest.approx(want) or time.monotonic() > deadline:
            return free
        time.sleep(0.2)


def test_on_a_gpu_cluster_each_rank_gets_a_gpu_of_its_own_from_ray():
    with _attached(LocalRayCluster(num_cpus=2, gpus=0, ray_gpus=2, memory_gb=2.0, object_store_memory_gb=0.3)):
        total = ray.cluster_resources()
        assert (total.get("GPU"), "tidal_gpu" in total) == (2.0, False)
        assert _settled("GPU", 2.0) == 2.0

        placement = place(load_config("tiny-cpu", OVERRIDES), NAMESPACE, [])
        (group,) = placement.groups
        held = f"GPU_group_{group.id.hex()}"
        assert [opts["num_gpus"] for opts in placement.trainer_ranks] == [1, 1]
        # the trainer's group holds both GPUs: the cluster's free GPU dropped by 2, the group's are free
        assert (_settled("GPU", 0.0), _settled(held, 2.0)) == (0.0, 2.0)

        probe = _probe_class()
        ranks = [probe.options(**opts).remote() for opts in placement.trainer_ranks]
        facade = probe.options(**placement.trainer).remote()
        seen = ray.get([actor.devices.remote() for actor in ranks], timeout=120)
        assert ray.get(facade.devices.remote(), timeout=120)[0::2] == ([], {})
        ids = [gpu_ids for gpu_ids, _, _ in seen]
        assert sorted(i for one in ids for i in one) == [0, 1] and all(len(one) == 1 for one in ids), seen
        assert [visible for _, visible, _ in seen] == [str(one[0]) for one in ids]
        assert [assigned for _, _, assigned in seen] == [{"GPU": 1.0}, {"GPU": 1.0}]
        # while the ranks live the group's GPUs are taken; the façade, asking nothing, is pinned
        # to bundle 0 all the same (each actor of the group holds 0.001 of its bundle's marker)
        assert _settled(held, 0.0) == 0.0
        assert _settled(f"bundle_group_0_{group.id.hex()}", 1000 - 3 * 0.001) == pytest.approx(999.997)

        for actor in (*ranks, facade):
            ray.kill(actor)
        release_placement(NAMESPACE)
        assert (_settled("GPU", 2.0), _settled(held, 0.0)) == (2.0, 0.0)


def test_on_an_emulated_cluster_each_rank_holds_one_tidal_gpu():
    with _attached(LocalRayCluster(num_cpus=2, gpus=2, ray_gpus=0, memory_gb=2.0, object_store_memory_gb=0.3)):
        assert "GPU" not in ray.cluster_resources()
        placement = place(load_config("tiny-cpu", OVERRIDES), NAMESPACE, [])
        (group,) = placement.groups
        held = f"tidal_gpu_group_{group.id.hex()}"
        assert _settled(held, 2.0) == 2.0

        probe = _probe_class()
        ranks = [probe.options(**opts).remote() for opts in placement.trainer_ranks]
        facade = probe.options(**placement.trainer).remote()
        seen = ray.get([actor.devices.remote() for actor in ranks], timeout=120)
        assert [assigned for _, _, assigned in seen] == [{"tidal_gpu": 1.0}, {"tidal_gpu": 1.0}]
        assert ray.get(facade.devices.remote(), timeout=120)[2] == {}
        assert (_settled(held, 0.0), _settled("tidal_gpu", 0.0)) == (0.0, 0.0)

        for actor in (*ranks, facade):
            ray.kill(actor)
        release_placement(NAMESPACE)
        assert _settled("tidal_gpu", 2.0) == 2.0


def test_on_a_labelled_gpu_cluster_rank_r_runs_on_the_trainer_node_of_bundle_r_per_node():
    """Two trainer nodes of one (advertised) GPU each, trainer 2 x 1: one rank per node, each on
    the node Ray put its bundle on, with that node's GPU; the façade on trainer node 0."""
    from ray.util.placement_group import placement_group_table

    trainer = {"tidal.io/role": "trainer"}
    nodes = LocalMultiNodeCluster(NodeSpec(gpus=0, num_cpus=2, memory_gb=2.0),
                                  [NodeSpec(gpus=0, ray_gpus=1, labels=trainer) for _ in range(2)])
    with _attached(nodes):
        cfg = load_config("tiny-cpu", ["trainer.nnodes=2", "trainer.n_gpus_per_node=1", "rollout.nnodes=0"])
        placement = place(cfg, NAMESPACE, [])
        (group,) = placement.groups
        bundle_nodes = placement_group_table(group)["bundles_to_node_id"]
        assert sorted(bundle_nodes.values()) == sorted(node.node_id for node in nodes.workers)

        probe = _probe_class()
        ranks = [probe.options(**opts).remote() for opts in placement.trainer_ranks]
        facade = probe.options(**placement.trainer).remote()
        assert ray.get([actor.node.remote() for actor in (*ranks, facade)], timeout=120) == [
            bundle_nodes[0], bundle_nodes[1], bundle_nodes[0]]
        assert ray.get([actor.devices.remote() for actor in ranks], timeout=120) == [
            ([0], "0", {"GPU": 1.0}), ([0], "0", {"GPU": 1.0})]  # each node's one GPU
        for actor in (*ranks, facade):
            ray.kill(actor)
