"""loop.balance: the one tie-break rule of production's load balancer and the simulator's."""

from __future__ import annotations

from loop.balance import least_loaded, replica_order


def test_replica_order_puts_standalones_first_then_hybrids_each_by_number():
    ids = ["hybrid-10", "standalone-10", "hybrid-2", "standalone-2", "standalone-0", "hybrid-0"]
    assert sorted(ids, key=replica_order) == [
        "standalone-0", "standalone-2", "standalone-10", "hybrid-0", "hybrid-2", "hybrid-10"]


def test_numbers_in_an_id_compare_as_numbers_so_a_replacement_sorts_next_to_its_slot():
    ids = ["standalone-1", "standalone-0.r1", "standalone-0", "standalone-0.r10", "standalone-0.r2"]
    assert sorted(ids, key=replica_order) == [
        "standalone-0", "standalone-0.r1", "standalone-0.r2", "standalone-0.r10", "standalone-1"]
    assert sorted(["b", "a", "a1", "a0"], key=replica_order) == ["a", "a0", "a1", "b"]


def test_the_least_loaded_wins_and_a_tie_goes_to_the_first_in_replica_order():
    loads = {"hybrid-0": 1, "standalone-3": 2, "standalone-1": 1}
    assert least_loaded(loads, loads.__getitem__) == "standalone-1"
    loads["hybrid-0"] = 0
    assert least_loaded(loads, loads.__getitem__) == "hybrid-0"


def test_objects_are_compared_by_the_id_they_name_and_nothing_gives_none():
    replicas = [("hybrid-0", 0), ("standalone-1", 0)]
    assert least_loaded(replicas, lambda r: r[1], lambda r: r[0]) == ("standalone-1", 0)
    assert least_loaded([], len) is None
