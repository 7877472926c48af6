"""The twin's length-aware admission and routing study knobs (``SimSpec.admission_lookahead``,
``admission_predict_sigma``, ``route_by_length``; issue 45 item 3): off, a run is what it was; on,
every sample is still trained once, admission starts longer samples first, and routing keeps the
long ones off the lent hybrids."""

from __future__ import annotations

import dataclasses
import statistics

from config import load_config
from policies import policy_from_config
from sim import simulate_spec, spec_from_config

from tests.sim.test_sim_invariants import assert_conserved

PRESET = "sim/qwen35-35b-tp4-dynamic"
STEPS = 12


def _run(**knobs):
    cfg = load_config(PRESET)
    spec = dataclasses.replace(spec_from_config(cfg, STEPS), **knobs)
    return simulate_spec(spec, policy_from_config(cfg), seed=1, trace=True)


def test_with_the_knobs_off_the_run_is_the_same_event_for_event():
    off = _run(admission_lookahead=0, route_by_length=False)
    assert off.trace == _run().trace


def test_longest_first_admission_trains_every_sample_once_and_starts_longer_ones_first():
    fifo, ahead = _run(), _run(admission_lookahead=64)

    assert_conserved(ahead)
    # sample ids count starts: the first 32 started are, with 64 drawn ahead, the longest of the
    # first draws, so their trained tokens are well above first-come's first 32 (the same draws)
    def first_started(r):
        tokens = dict(zip(r.trained_ids, r.trained_tokens))
        return statistics.fmean(tokens[i] for i in range(32))

    assert len(ahead.trained_ids) == len(fifo.trained_ids)
    assert first_started(ahead) > 1.3 * first_started(fifo)


def test_routing_by_length_keeps_every_sample_and_aborts_less_on_the_take_back():
    fifo, routed = _run(), _run(route_by_length=True)

    assert_conserved(routed)
    assert routed.waste.aborted_tokens < fifo.waste.aborted_tokens
