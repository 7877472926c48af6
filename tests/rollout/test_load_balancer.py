"""The load balancer routes sticky-then-least-loaded, over a replica set that changes under it."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from loop.controller import LoadBalancer as LoadBalancerProtocol
from rollout.load_balancer import LoadBalancer


def test_a_new_request_goes_to_the_least_loaded_replica_and_ties_go_to_the_first_in_replica_order():
    lb = LoadBalancer(["r2", "r1", "r3"])
    assert lb.acquire("a") == "r1"  # all idle: lowest number
    assert lb.acquire("b") == "r2"
    assert lb.acquire("c") == "r3"
    assert lb.acquire("d") == "r1"  # all at 1 again
    lb.release("r2")
    assert lb.acquire("e") == "r2"  # the only one at 1
    assert lb.loads() == {"r1": 2, "r2": 1, "r3": 1}


def test_ties_go_to_standalones_before_hybrids_and_numbers_compare_as_numbers():
    """loop.balance's rule, the simulator's too: hybrid-0 no longer wins a tie by string order."""
    lb = LoadBalancer(["hybrid-0", "standalone-10", "standalone-2", "hybrid-1"])
    assert [lb.acquire(key) for key in "abcde"] == [
        "standalone-2", "standalone-10", "hybrid-0", "hybrid-1", "standalone-2"]


def test_a_sticky_request_returns_to_its_replica_even_when_another_is_less_loaded():
    lb = LoadBalancer(["r1", "r2"])
    assert lb.acquire("req") == "r1"
    assert lb.acquire("x") == "r2"
    assert lb.acquire("y") == "r1"  # tie at 1: smallest id
    assert lb.loads() == {"r1": 2, "r2": 1}
    assert lb.acquire("req") == "r1"  # sticky beats least loaded
    assert lb.sticky_replica("req") == "r1"
    lb.forget("req")
    assert lb.acquire("req") == "r2"  # forgotten: least loaded again


def test_removing_a_replica_drops_its_sticky_entries_so_the_retry_routes_elsewhere():
    lb = LoadBalancer(["r1", "r2"])
    assert lb.acquire("req") == "r1"
    lb.remove_replicas(["r1"])
    assert lb.sticky_replica("req") is None
    assert lb.acquire("req") == "r2"
    assert lb.active_ids() == ("r2",)


def test_a_removed_replica_keeps_its_in_flight_count_until_released_then_disappears():
    lb = LoadBalancer(["r1", "r2"])
    lb.acquire("a")
    lb.acquire("b")
    lb.acquire("c")  # r1: 2, r2: 1
    lb.remove_replicas(["r1"])
    assert lb.in_flight(["r1"]) == 2
    assert lb.in_flight() == 3
    lb.release("r1")
    lb.release("r1")
    assert lb.in_flight(["r1"]) == 0
    assert "r1" not in lb.loads()


def test_an_id_added_twice_is_counted_once():
    lb = LoadBalancer(["r1", "r1"])
    lb.add_replicas(["r1", "r2", "r2"])
    assert lb.num_active == 2
    assert lb.active_ids() == ("r1", "r2")
    assert lb.in_flight(["r1", "r1"]) == 0
    lb.acquire("k")
    assert lb.in_flight(["r1", "r1"]) == 1  # the same id asked twice is summed once


def test_in_flight_never_goes_negative_and_stray_releases_are_counted():
    lb = LoadBalancer(["r1"])
    lb.release("r1")
    lb.release("ghost")
    assert lb.loads() == {"r1": 0}
    assert lb.stats()["ignored_releases"] == 2
    lb.acquire("k")
    lb.release("r1")
    lb.release("r1")
    assert lb.in_flight() == 0


def test_acquire_returns_none_and_counts_nothing_when_no_replica_is_routable():
    lb = LoadBalancer()
    assert lb.acquire("k") is None
    assert lb.in_flight() == 0
    assert lb.stats()["acquired"] == 0


def test_clear_sticky_forgets_every_entry_and_says_how_many():
    lb = LoadBalancer(["r1", "r2"])
    for key in ("a", "b", "c"):
        lb.acquire(key)
    lb.forget("c")
    assert lb.clear_sticky() == 2
    assert lb.clear_sticky() == 0
    assert lb.sticky_replica("a") is None


def test_listeners_hear_the_new_active_count_only_when_the_routable_set_changes():
    lb = LoadBalancer()
    heard: list[int] = []
    unsubscribe = lb.on_change(heard.append)
    lb.add_replicas(["r1", "r2"])
    lb.add_replicas(["r1"])  # no change
    lb.remove_replicas(["ghost"])  # no change
    lb.remove_replicas(["r1"])
    unsubscribe()
    lb.add_replicas(["r3"])
    assert heard == [2, 1]


def test_wait_routable_returns_only_once_a_replica_is_added():
    async def scenario() -> tuple[bool, bool]:
        lb = LoadBalancer()
        waiter = asyncio.ensure_future(lb.wait_routable())
        for _ in range(5):
            await asyncio.sleep(0)
        done_before = waiter.done()
        lb.add_replicas(["r1"])
        await asyncio.wait_for(waiter, 1.0)
        return done_before, waiter.done()

    assert asyncio.run(scenario()) == (False, True)


def test_the_balancer_satisfies_the_controllers_protocol():
    lb: LoadBalancerProtocol = LoadBalancer(["h0"])
    lb.add_replicas(["s0"])
    lb.remove_replicas(["h0"])
    assert lb.clear_sticky() == 0
    assert lb.in_flight(None) == 0


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.sampled_from("abcd"), max_size=3)),
        st.tuples(st.just("remove"), st.lists(st.sampled_from("abcd"), max_size=3)),
        st.tuples(st.just("acquire"), st.sampled_from(["k1", "k2", "k3", "k4"])),
        st.tuples(st.just("release"), st.sampled_from("abcde")),
        st.tuples(st.just("clear"), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_in_flight_counts_always_match_the_acquires_not_yet_released(ops):
    lb = LoadBalancer()
    outstanding: dict[str, int] = {}
    active: set[str] = set()
    for op, arg in ops:
        if op == "add":
            lb.add_replicas(arg)
            active |= set(arg)
        elif op == "remove":
            lb.remove_replicas(arg)
            active -= set(arg)
        elif op == "acquire":
            rid = lb.acquire(arg)
            if active:
                assert rid in active
                outstanding[rid] = outstanding.get(rid, 0) + 1
            else:
                assert rid is None
        elif op == "release":
            lb.release(arg)
            if outstanding.get(arg, 0) > 0:
                outstanding[arg] -= 1
        else:
            lb.clear_sticky()
        assert lb.num_active == len(active)
        assert all(count >= 0 for count in lb.loads().values())
        assert lb.in_flight() == sum(outstanding.values())
        for rid in "abcde":
            assert lb.in_flight([rid]) == outstanding.get(rid, 0)
