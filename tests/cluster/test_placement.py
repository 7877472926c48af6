"""The capacity check of cluster/placement.py on node lists (no Ray): what a config asks of the
cluster, and the one line that says what is missing; which accelerator a cluster is asked for; the
``.options(...)`` of every actor (trainer, its ranks, replicas) in each mode, on stand-in groups."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.placement import (
    Demand,
    NodeView,
    accelerator_of,
    asking,
    labelled,
    nodes_of,
    replica_bundles,
    scheduling,
    shortfall,
    trainer_bundles,
)
from config import load_config
from config.placement_keys import PlacementSection

KEYS = PlacementSection()


def _node(i: int, role: str | None, gpus: float) -> NodeView:
    return NodeView(f"n{i}", role, gpus)


def _gpu_node(i: int, role: str | None, gpus: float) -> NodeView:
    """A node of a GPU cluster: Ray's own GPU, no tidal_gpu."""
    return NodeView(f"n{i}", role, 0.0, gpus)


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


# ------------------------------------------------------------------------------------------------
# the accelerator: Ray's GPU on a GPU cluster, tidal_gpu on an emulated one
# ------------------------------------------------------------------------------------------------


def test_nodes_of_reads_rays_own_gpu_count_beside_the_emulated_one():
    raw = [{"NodeID": "a", "Alive": True, "Labels": {}, "Resources": {"GPU": 8.0, "tidal_gpu": 2.0}},
           {"NodeID": "b", "Alive": True, "Labels": {}, "Resources": {"CPU": 4.0}}]
    assert nodes_of(raw, "tidal.io/role") == [NodeView("a", None, 2.0, 8.0), NodeView("b", None, 0.0, 0.0)]


def test_a_cluster_is_a_gpu_cluster_when_some_alive_node_advertises_rays_gpu():
    assert accelerator_of([_node(0, None, 0), _gpu_node(1, None, 1)]) == "GPU"
    assert accelerator_of([_node(0, None, 4), NodeView("n1", None, 4.0, 0.0)]) == "tidal_gpu"
    assert accelerator_of([]) == "tidal_gpu"
    dead_gpu = [{"NodeID": "a", "Alive": False, "Labels": {}, "Resources": {"GPU": 8.0}},
                {"NodeID": "b", "Alive": True, "Labels": {}, "Resources": {"tidal_gpu": 2.0}}]
    assert accelerator_of(nodes_of(dead_gpu, "tidal.io/role")) == "tidal_gpu"


def test_asking_for_accelerators_is_num_gpus_on_a_gpu_cluster_and_the_custom_resource_when_emulated():
    assert asking("GPU", 2) == {"num_gpus": 2}
    assert asking("tidal_gpu", 2) == {"resources": {"tidal_gpu": 2}}
    assert asking("GPU", 0) == asking("tidal_gpu", 0) == {}


def test_a_gpu_cluster_is_checked_in_gpus_and_its_tidal_gpu_is_ignored():
    nodes = [NodeView("n0", None, 4.0, 1.0)]  # one real GPU, four emulated: the run asks for GPUs
    assert shortfall(Demand(1, 1, 1, 1, 1), nodes, KEYS) == (
        "2 GPU (1 for the trainer, 1 per standalone replica, each on one node); found 1 on 1 node(s), "
        "no room left for standalone replica 0's 1")
    assert shortfall(Demand(1, 1, 0, 1, 1), nodes, KEYS) is None


def test_labelled_gpu_nodes_with_too_few_gpus_are_named_in_gpus():
    nodes = [_gpu_node(1, "trainer", 8), _gpu_node(2, "trainer", 4), _gpu_node(3, "rollout", 8)]
    assert shortfall(Demand(2, 8, 1, 8, 8), nodes, KEYS) == (
        "2 trainer node(s) (label tidal.io/role=trainer) with 8 GPU each, found 2, 1 of them with fewer GPU")
    assert shortfall(Demand(2, 8, 1, 8, 8), [*nodes[:1], _gpu_node(2, "trainer", 8), nodes[2]], KEYS) is None


# ------------------------------------------------------------------------------------------------
# the trainer as ranks: one per accelerator, asked for per trainer node
# ------------------------------------------------------------------------------------------------


def test_a_trainer_of_one_accelerator_has_no_ranks_and_a_bigger_one_has_one_rank_per_accelerator():
    assert Demand(1, 1, 1, 1, 1).trainer_ranks == 0
    assert Demand(1, 2, 0, 1, 1).trainer_ranks == 2
    assert Demand(2, 8, 1, 8, 8).trainer_ranks == 16


def test_an_unlabelled_cluster_fits_a_two_node_trainer_on_two_nodes_of_its_per_node_size():
    two_eights = [_gpu_node(0, None, 8), _gpu_node(1, None, 8)]
    assert shortfall(Demand(2, 8, 0, 1, 8), two_eights, KEYS) is None
    assert shortfall(Demand(2, 8, 0, 1, 8), [_gpu_node(0, None, 16)], KEYS) is None  # both blocks on one node
    assert shortfall(Demand(2, 8, 1, 8, 8), [*two_eights, _gpu_node(2, None, 8)], KEYS) is None


def test_an_unlabelled_cluster_too_small_for_a_trainer_node_names_that_node_in_one_line():
    assert shortfall(Demand(2, 8, 0, 1, 8), [_gpu_node(0, None, 8), _gpu_node(1, None, 4)], KEYS) == (
        "16 GPU (16 for the trainer as 2 nodes of 8, 8 per standalone replica, each on one node); "
        "found 12 on 2 node(s), no room left for trainer node 1's 8")
    assert shortfall(Demand(2, 2, 1, 2, 2), [_node(0, None, 3), _node(1, None, 3)], KEYS) == (
        "6 tidal_gpu (4 for the trainer as 2 nodes of 2, 2 per standalone replica, each on one node); "
        "found 6 on 2 node(s), no room left for standalone replica 0's 2")


def test_the_trainers_group_has_one_bundle_per_trainer_node_and_a_replicas_one_per_accelerator():
    demand = Demand(2, 4, 1, 2, 2)
    assert trainer_bundles(demand, "GPU") == [{"GPU": 4}, {"GPU": 4}]
    assert trainer_bundles(demand, "tidal_gpu") == [{"tidal_gpu": 4}, {"tidal_gpu": 4}]
    assert replica_bundles(demand, "GPU") == [{"GPU": 1}, {"GPU": 1}]


# ------------------------------------------------------------------------------------------------
# the .options(...) of each actor (stand-in placement groups: scheduling makes no Ray call)
# ------------------------------------------------------------------------------------------------

TRAINER_PG, CONTROL = object(), {"num_cpus": 0, "scheduling_strategy": "the driver's node"}
ONE_EACH = [("GPU", {"num_gpus": 1}), ("tidal_gpu", {"resources": {"tidal_gpu": 1}})]
"""Each accelerator and the options that ask for one of it."""
REPLICA_PGS = {"standalone-0": object(), "standalone-1": object()}


def _where(options: dict[str, Any]) -> tuple[dict[str, Any], Any, int]:
    """``options`` without its scheduling strategy, the group it names and the bundle index."""
    rest = {k: v for k, v in options.items() if k != "scheduling_strategy"}
    strategy = options["scheduling_strategy"]
    return rest, strategy.placement_group, strategy.placement_group_bundle_index


@pytest.mark.parametrize(("accelerator", "one"), ONE_EACH)
def test_an_unlabelled_one_accelerator_trainer_asks_ray_directly_and_has_no_ranks(accelerator, one):
    placed = scheduling(Demand(1, 1, 2, 1, 1), accelerator, list(REPLICA_PGS))
    assert (placed.trainer, placed.trainer_ranks, placed.control, placed.groups) == (one, [], {}, [])
    assert placed.replicas == {"standalone-0": one, "standalone-1": one}


def test_unlabelled_standalone_replicas_ask_for_their_whole_tensor_parallel_size():
    assert scheduling(Demand(1, 1, 1, 2, 2), "GPU", ["standalone-0"]).replica("standalone-0") == {"num_gpus": 2}
    assert scheduling(Demand(1, 1, 1, 2, 2), "tidal_gpu", ["standalone-0"]).replica("standalone-0") == {
        "resources": {"tidal_gpu": 2}}


@pytest.mark.parametrize(("accelerator", "one"), ONE_EACH)
def test_ranks_ask_one_accelerator_and_no_cpu_each_in_the_bundle_of_their_trainer_node(accelerator, one):
    placed = scheduling(Demand(2, 2, 0, 1, 1), accelerator, [], trainer_group=TRAINER_PG)
    assert [_where(rank) for rank in placed.trainer_ranks] == [
        ({"num_cpus": 0, **one}, TRAINER_PG, 0), ({"num_cpus": 0, **one}, TRAINER_PG, 0),
        ({"num_cpus": 0, **one}, TRAINER_PG, 1), ({"num_cpus": 0, **one}, TRAINER_PG, 1)]


@pytest.mark.parametrize("accelerator", ["GPU", "tidal_gpu"])
def test_with_ranks_the_trainer_actor_asks_for_nothing_and_runs_on_trainer_node_0(accelerator):
    placed = scheduling(Demand(2, 4, 0, 1, 1), accelerator, [], trainer_group=TRAINER_PG)
    assert _where(placed.trainer) == ({"num_cpus": 0}, TRAINER_PG, 0)
    assert len(placed.trainer_ranks) == 8


def test_a_labelled_run_places_ranks_replicas_and_control_actors_in_their_own_groups():
    placed = scheduling(Demand(2, 2, 2, 2, 2), "GPU", list(REPLICA_PGS), trainer_group=TRAINER_PG,
                        replica_groups=REPLICA_PGS, control=CONTROL)
    assert [_where(rank)[1:] for rank in placed.trainer_ranks] == [(TRAINER_PG, 0), (TRAINER_PG, 0),
                                                                   (TRAINER_PG, 1), (TRAINER_PG, 1)]
    assert {rid: _where(opts) for rid, opts in placed.replicas.items()} == {
        rid: ({"num_cpus": 0, "num_gpus": 1}, group, 0) for rid, group in REPLICA_PGS.items()}
    assert placed.control == CONTROL


@pytest.mark.parametrize(("accelerator", "one"), ONE_EACH)
def test_a_labelled_one_accelerator_trainer_holds_it_in_bundle_0_as_before(accelerator, one):
    placed = scheduling(Demand(1, 1, 1, 1, 1), accelerator, ["standalone-0"], trainer_group=TRAINER_PG,
                        replica_groups={"standalone-0": REPLICA_PGS["standalone-0"]}, control=CONTROL)
    assert _where(placed.trainer) == ({"num_cpus": 0, **one}, TRAINER_PG, 0)
    assert placed.trainer_ranks == []
    assert _where(placed.replica("standalone-0")) == ({"num_cpus": 0, **one}, REPLICA_PGS["standalone-0"], 0)


def test_a_trainer_of_several_ranks_is_never_placed_without_its_group():
    with pytest.raises(ValueError, match="a trainer of 2 ranks is placed in its placement group"):
        scheduling(Demand(1, 2, 0, 1, 1), "GPU", [])


# ------------------------------------------------------------------------------------------------
# which trainer ranks each hybrid replica spans (cluster.actors.trainer_rank.hybrid_hosts)


def test_each_hybrid_spans_tp_consecutive_ranks_of_one_node_and_lives_on_the_first():
    from cluster.actors.trainer_rank import hybrid_hosts

    ids = [f"hybrid-{k}" for k in range(4)]
    # 2 nodes × 4 GPUs, TP 2: two replicas per node, never across the node boundary (ranks 3|4)
    assert hybrid_hosts(ids, world=8, per_node=4, tp=2) == {
        "hybrid-0": [0, 1], "hybrid-1": [2, 3], "hybrid-2": [4, 5], "hybrid-3": [6, 7]}
    # CPU: TP 1, one replica per rank; k-of-m lending lends the first k of these
    assert hybrid_hosts(ids[:2], world=2, per_node=2, tp=1) == {"hybrid-0": [0], "hybrid-1": [1]}
    with pytest.raises(ValueError, match="within one node"):
        hybrid_hosts(ids[:1], world=6, per_node=3, tp=2)  # a replica would straddle two nodes
    with pytest.raises(ValueError, match="need 6 trainer ranks"):
        hybrid_hosts(ids[:3], world=4, per_node=4, tp=2)


def test_what_a_trainer_gpu_keeps_while_lent_follows_sharding_and_offload():
    from cluster.placement import trainer_bytes_while_lent

    def kept(*overrides):
        return trainer_bytes_while_lent(load_config("tiny-cpu", ["trainer.n_gpus_per_node=4", *overrides]), 1000)

    # FSDP2 shards everything over 4 ranks; AdamW state and gradients offloaded by default
    assert kept() == {"parameters": 1000.0, "gradients and AdamW state": 0.0}
    assert kept("actor_rollout_ref.actor.fsdp_config.optimizer_offload=false") == {
        "parameters": 1000.0, "gradients and AdamW state": 3000.0}
    assert kept("actor_rollout_ref.actor.fsdp_config.param_offload=true")["parameters"] == 0.0
    # ZeRO 1-2 keep whole parameters on every rank, ZeRO-3 shards them
    assert kept("engines.train=deepspeed")["parameters"] == 4000.0
    assert kept("engines.train=deepspeed", "engines.deepspeed_zero_stage=3")["parameters"] == 1000.0


def test_a_hybrid_share_is_checked_only_for_vllm_hybrids_on_a_gpu_of_known_size():
    from cluster.placement import ClusterTooSmall, check_hybrid_memory

    base = ["engines.rollout=vllm", "model.n_head=2", "actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false"]
    check_hybrid_memory(load_config("tiny-cpu", base))  # no trainer.gpu_memory_gb: nothing to check
    check_hybrid_memory(load_config("tiny-cpu", [*base[1:], "trainer.gpu_memory_gb=0.004"]))  # torch engine
    check_hybrid_memory(load_config("tiny-cpu", [*base, "trainer.gpu_memory_gb=1"]))  # fits
    with pytest.raises(ClusterTooSmall, match="lower it to 0.57 or less"):
        check_hybrid_memory(load_config("tiny-cpu", [*base, "trainer.gpu_memory_gb=0.004"]))
    with pytest.raises(ClusterTooSmall, match="the trainer alone keeps"):
        check_hybrid_memory(load_config("tiny-cpu", [*base, "trainer.gpu_memory_gb=0.001"]))
