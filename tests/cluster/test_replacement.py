"""Replacing dead standalone replicas: ids, the per-slot bound and the record (pure, no Ray)."""

from __future__ import annotations

import logging

import pytest

from cluster.replacement import ReplicaReplacer


def test_each_death_gets_a_new_unique_id_in_its_slot_until_the_slot_budget_is_spent(caplog):
    replacer = ReplicaReplacer(["standalone-0", "standalone-1"], max_replacements=2)

    assert replacer.on_failure("standalone-0", now=10.0) == "standalone-0.r1"
    replacer.joined("standalone-0.r1", now=12.5, version=3)
    assert replacer.on_failure("standalone-0.r1", now=20.0) == "standalone-0.r2"
    replacer.start_failed("standalone-0.r2", "timed out")
    with caplog.at_level(logging.WARNING, logger="cluster.replacement"):
        assert replacer.on_failure("standalone-0.r2", now=30.0) is None  # 2 spent: stays out
    assert "slot standalone-0 was replaced 2 time(s) already" in caplog.text
    assert "stays out" in caplog.text
    # the other slot has its own budget
    assert replacer.on_failure("standalone-1", now=40.0) == "standalone-1.r1"

    assert [(r["failed"], r["replacement"], r["status"]) for r in replacer.records()] == [
        ("standalone-0", "standalone-0.r1", "joined"),
        ("standalone-0.r1", "standalone-0.r2", "start_failed"),
        ("standalone-0.r2", None, "not_replaced"),
        ("standalone-1", "standalone-1.r1", "starting"),
    ]
    first = replacer.records()[0]
    assert (first["slot"], first["failed_at"], first["joined_at"], first["version"]) == ("standalone-0", 10.0, 12.5, 3)
    assert replacer.replaced == 1
    assert (replacer.spent("standalone-0"), replacer.spent("standalone-1")) == (2, 1)
    assert replacer.slot_of("standalone-0.r2") == "standalone-0"


def test_a_zero_budget_never_replaces_and_repeated_or_foreign_deaths_are_ignored():
    replacer = ReplicaReplacer(["standalone-0"], max_replacements=0)
    assert replacer.on_failure("standalone-0", now=1.0) is None
    assert replacer.on_failure("standalone-0", now=2.0) is None  # the same death, reported again
    assert replacer.on_failure("hybrid-0", now=3.0) is None  # not a standalone replica
    assert [r["status"] for r in replacer.records()] == ["not_replaced"]

    once = ReplicaReplacer(["standalone-0"], max_replacements=5)
    assert once.on_failure("standalone-0", now=1.0) == "standalone-0.r1"
    assert once.on_failure("standalone-0", now=1.5) is None  # one replacement per death
    assert once.spent("standalone-0") == 1


def test_a_negative_budget_is_rejected():
    with pytest.raises(ValueError, match="max_replacements"):
        ReplicaReplacer(["standalone-0"], max_replacements=-1)


def test_a_resumed_run_continues_the_budget_and_the_ids_from_the_committed_state():
    before = ReplicaReplacer(["standalone-0", "standalone-1"], max_replacements=2)
    assert before.on_failure("standalone-0", now=1.0) == "standalone-0.r1"
    before.joined("standalone-0.r1", now=2.0, version=1)
    state = before.state_dict()
    assert state == {"spent": {"standalone-0": 1, "standalone-1": 0}, "joined": 1}

    # the driver died; the resumed run starts fresh actors under the original ids
    after = ReplicaReplacer(["standalone-0", "standalone-1"], max_replacements=2, state=state)
    assert after.replaced == 1 and after.spent("standalone-0") == 1
    assert after.on_failure("standalone-0", now=3.0) == "standalone-0.r2"  # not .r1 a second time
    after.joined("standalone-0.r2", now=4.0, version=5)
    assert after.on_failure("standalone-0.r2", now=5.0) is None  # two per slot over the whole run
    assert after.on_failure("standalone-1", now=6.0) == "standalone-1.r1"
    assert after.state_dict() == {"spent": {"standalone-0": 2, "standalone-1": 1}, "joined": 2}
    assert ReplicaReplacer(["standalone-0"], 1, state={}).state_dict() == {"spent": {"standalone-0": 0}, "joined": 0}
