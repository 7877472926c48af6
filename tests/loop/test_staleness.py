"""loop.staleness: the gate both rollouters start samples under, and the history change points."""

from __future__ import annotations

from loop.staleness import StalenessGate, record_change


def test_the_capacity_follows_the_routable_replicas_up_to_max_required():
    gate = StalenessGate(max_required_samples=10, concurrent_samples_per_replica=4)
    assert [gate.set_routable(n) for n in (1, 1, 2, 3, 4)] == [True, False, True, True, False]
    assert gate.capacity == 10  # 3 × 4 and 4 × 4 are both capped at max_required


def test_starts_stop_at_the_capacity_the_versions_cap_and_a_full_queue():
    gate = StalenessGate(max_required_samples=6, concurrent_samples_per_replica=4)
    gate.set_routable(1)
    assert [gate.allows(in_flight, 0) for in_flight in (3, 4)] == [True, False]
    assert [gate.allows(0, queued) for queued in (5, 6)] == [True, False]
    assert [gate.allows(0, queued, queue_capacity=8) for queued in (7, 8)] == [True, False]
    for _ in range(6):
        gate.started()
    assert (gate.started_this_version, gate.allows(0, 0)) == (6, False)  # the version's cap


def test_a_sync_counts_what_is_in_flight_or_queued_as_started_in_the_new_version():
    gate = StalenessGate(max_required_samples=6, concurrent_samples_per_replica=4, capacity=4, started_this_version=6)
    gate.on_sync(in_flight=2, queued=3)
    assert (gate.started_this_version, gate.allows(2, 3)) == (5, True)


def test_the_history_keeps_change_points_and_replaces_a_point_at_the_same_time():
    history = [(0.0, 0, 4)]
    for point in [(1.0, 1, 4), (1.0, 2, 4), (2.0, 2, 4), (3.0, 2, 8), (3.5, 0, 8)]:
        record_change(history, *point)
    assert history == [(0.0, 0, 4), (1.0, 2, 4), (3.0, 2, 8), (3.5, 0, 8)]
