"""The capacity check of cluster/placement.py on node lists (no Ray): what a config asks of the
cluster, and the one line that says what is missing."""

from __future__ import annotations

from cluster.placement import Demand, NodeView, labelled, nodes_of, shortfall
from config import load_config
from config.placement_keys import PlacementSection

KEYS = PlacementSection()


def _node(i: int, role: str | None, gpus: float) -> NodeView:
    return NodeView(f"n{i}", role, gpus)


def test_a_demand_maps_the_nnodes_and_gpus_per_node_keys_and_the_replica_size():
    cfg = load_config("tiny-cpu", ["trainer.nnodes=2", "trainer.n_gpus_per_node=4", "rollout.nnodes=3",
                                   "rollout.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    demand = Demand.of(cfg)
    assert demand == Demand(trainer_nodes=2, trainer_gpus_per_node=4, rollout_nodes=3, rollout_gpus_per_node=2,
                            gpus_per_replica=2)
    assert (demand.trainer_gpus, demand.standalone_replicas) == (8, 3)


def test_nodes_of_keeps_alive_nodes_with_their_role_label_and_emulated_gpus():
    raw = [
        {"NodeID": "a", "Alive": True, "Labels": {"tidal.io/role": "trainer"}, "Resources": {"tidal_gpu": 2.0}},
        {"NodeID": "b", "Alive": False, "Labels": {"tidal.io/role": "rollout"}, "Resources": {"tidal_gpu": 1.0}},
        {"NodeID": "c", "Alive": True, "Labels": {}, "Resources": {"CPU": 2.0}},
    ]
    assert nodes_of(raw, "tidal.io/role") == [NodeView("a", "trainer", 2.0), NodeView("c", None, 0.0)]


def test_a_labelled_cluster_with_enough_nodes_of_each_role_fits():
    nodes = [_node(0, None, 0), _node(1, "trainer", 1), _node(2, "rollout", 1), _node(3, "rollout", 1)]
    assert labelled(nodes, KEYS) is True
    assert shortfall(Demand(1, 1, 2, 1, 1), nodes, KEYS) is None


def test_a_missing_rollout_node_is_named_with_its_label_and_gpus():
    nodes = [_node(1, "trainer", 1), _node(2, "rollout", 1), _node(3, "rollout", 1)]
    assert shortfall(Demand(1, 1, 3, 1, 1), nodes, KEYS) == (
        "3 rollout node(s) (label tidal.io/role=rollout) with 1 tidal_gpu each, found 2")


def test_trainer_nodes_with_too_few_gpus_are_counted_but_do_not_fit():
    nodes = [_node(1, "trainer", 2), _node(2, "trainer", 4), _node(3, "rollout", 1)]
    assert shortfall(Demand(2, 4, 1, 1, 1), nodes, KEYS) == (
        "2 trainer node(s) (label tidal.io/role=trainer) with 4 tidal_gpu each, found 2, 1 of them with fewer tidal_gpu")


def test_both_roles_short_and_a_replica_split_across_nodes_are_all_reported_in_one_line():
    nodes = [_node(1, "rollout", 3)]
    assert shortfall(Demand(1, 1, 2, 3, 2), nodes, KEYS) == (
        "1 trainer node(s) (label tidal.io/role=trainer) with 1 tidal_gpu each, found 0; "
        "2 rollout node(s) (label tidal.io/role=rollout) with 3 tidal_gpu each, found 1; "
        "rollout.n_gpus_per_node=3 holding whole replicas of tensor_model_parallel_size=2")


def test_an_only_hybrid_config_needs_no_rollout_node():
    assert shortfall(Demand(1, 2, 0, 1, 1), [_node(1, "trainer", 2)], KEYS) is None


def test_an_unlabelled_one_node_cluster_sized_for_the_run_fits_as_before():
    nodes = [_node(0, None, 2)]
    assert labelled(nodes, KEYS) is False
    assert shortfall(Demand(1, 1, 1, 1, 1), nodes, KEYS) is None


def test_an_unlabelled_cluster_places_the_trainer_and_each_replica_on_one_node_first_fit():
    nodes = [_node(0, None, 2), _node(1, None, 2)]
    assert shortfall(Demand(1, 2, 1, 2, 2), nodes, KEYS) is None  # trainer on one, the replica on the other
    assert shortfall(Demand(1, 1, 1, 3, 1), nodes, KEYS) is None  # 1 + 3 single-GPU replicas in 4 GPUs
    assert shortfall(Demand(1, 3, 1, 1, 1), nodes, KEYS) == (
        "4 tidal_gpu (3 for the trainer, 1 per standalone replica, each on one node); found 4 on 2 node(s), "
        "no room left for the trainer's 3")


def test_an_attached_cluster_without_the_gpu_resource_is_too_small():
    assert shortfall(Demand(1, 1, 1, 1, 1), [_node(0, None, 0)], KEYS) == (
        "2 tidal_gpu (1 for the trainer, 1 per standalone replica, each on one node); found 0 on 1 node(s), "
        "no room left for the trainer's 1")


def test_custom_role_names_come_from_the_ray_placement_keys():
    keys = PlacementSection(role_label="example.com/pool", trainer_role="train", rollout_role="gen")
    raw = [{"NodeID": "a", "Alive": True, "Labels": {"example.com/pool": "train"}, "Resources": {"tidal_gpu": 1}},
           {"NodeID": "b", "Alive": True, "Labels": {"example.com/pool": "gen"}, "Resources": {"tidal_gpu": 1}}]
    assert shortfall(Demand(1, 1, 1, 1, 1), nodes_of(raw, keys.role_label), keys) is None
    assert shortfall(Demand(1, 1, 2, 1, 1), nodes_of(raw, keys.role_label), keys) == (
        "2 gen node(s) (label example.com/pool=gen) with 1 tidal_gpu each, found 1")
