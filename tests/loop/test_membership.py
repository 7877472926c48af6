"""The one view of a run's standalone replicas: deaths, replacements starting, joining or failing."""

from __future__ import annotations

import pytest

from loop.membership import Membership

SLOTS = ("standalone-0", "standalone-1")


def view(m: Membership) -> dict:
    return {"routable": m.routable(), "dead": m.dead(), "replacing": m.replacing_ids(), "alive": m.alive(),
            "lost": m.standalone_lost}


def test_a_fresh_run_has_every_standalone_replica_routable():
    assert view(Membership(SLOTS, ("hybrid-0",))) == {
        "routable": SLOTS, "dead": (), "replacing": (), "alive": SLOTS, "lost": False}


def test_a_death_takes_the_replica_out_and_a_second_report_of_it_is_no_news():
    m = Membership(SLOTS)

    assert m.died("standalone-0") is True
    assert m.died("standalone-0") is False
    assert m.died("hybrid-0") is False  # not a standalone replica of this run

    assert view(m) == {"routable": ("standalone-1",), "dead": ("standalone-0",), "replacing": (),
                       "alive": ("standalone-1",), "lost": False}


def test_a_replacement_is_alive_but_not_routable_until_it_joins_in_the_dead_ones_slot():
    m = Membership(SLOTS)
    m.died("standalone-0")

    m.replacing("standalone-0", "standalone-0.r1")
    starting = view(m)
    m.joined("standalone-0", "standalone-0.r1")

    assert starting == {"routable": ("standalone-1",), "dead": ("standalone-0",),
                        "replacing": ("standalone-0.r1",), "alive": ("standalone-1", "standalone-0.r1"),
                        "lost": False}
    assert view(m) == {"routable": ("standalone-0.r1", "standalone-1"), "dead": ("standalone-0",),
                       "replacing": (), "alive": ("standalone-0.r1", "standalone-1"), "lost": False}


def test_a_replacement_that_fails_to_start_counts_as_a_death_of_its_own():
    m = Membership(SLOTS)
    m.died("standalone-1")
    m.replacing("standalone-1", "standalone-1.r1")

    m.replacement_failed("standalone-1.r1")

    assert view(m) == {"routable": ("standalone-0",), "dead": ("standalone-1", "standalone-1.r1"),
                       "replacing": (), "alive": ("standalone-0",), "lost": False}


def test_with_every_standalone_replica_dead_the_run_has_lost_them_until_a_replacement_joins():
    m = Membership(SLOTS)
    m.died("standalone-0")
    m.died("standalone-1")
    m.replacing("standalone-0", "standalone-0.r1")
    lost_while_starting = m.standalone_lost

    m.joined("standalone-0", "standalone-0.r1")

    assert (lost_while_starting, m.standalone_lost) == (True, False)


def test_an_only_hybrid_run_has_lost_nothing():
    assert Membership((), ("hybrid-0",)).standalone_lost is False


def test_an_id_in_use_cannot_be_a_replacement():
    m = Membership(SLOTS, ("hybrid-0",))
    m.died("standalone-0")

    with pytest.raises(ValueError, match="'standalone-1' is already in use"):
        m.replacing("standalone-0", "standalone-1")
    with pytest.raises(ValueError, match="'hybrid-0' is already in use"):
        m.joined("standalone-0", "hybrid-0")
