"""loop.workload: one length model, drawn in sequence (the simulator) or keyed (the emulated engine)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from cluster.engines.base import request_sample_uid
from loop.workload import LengthModel, SeededLengths

PARAMS = dict(mean_start=100, mean_end=300, response_sigma=0.4, prompt_sigma=0.5, max_len=10**9, last_version=10)


def prompt_of(request_id: str) -> str:
    return request_id.rsplit("-r", 1)[0]


def test_the_mean_drifts_linearly_to_the_last_version_and_stays_there():
    model = LengthModel(**PARAMS)
    assert [model.mean(v) for v in (0, 5, 10, 20)] == [100, 200, 300, 300]
    assert LengthModel(**{**PARAMS, "last_version": 0}).mean(0) == 300


def test_both_forms_have_the_drifting_mean_and_share_the_prompt_factor_within_a_sample():
    rng = random.Random(7)
    drawn = [LengthModel(**PARAMS).draw(rng, 8, 5) for _ in range(600)]
    keyed = SeededLengths(**PARAMS, seed=3, prompt_key=prompt_of)
    looked_up = [[keyed(f"e0-p{i}-r{j}", 5) for j in range(8)] for i in range(600)]
    for samples in (drawn, looked_up):
        assert statistics.fmean(x for sample in samples for x in sample) == pytest.approx(200, rel=0.05)
        logs = [[math.log(x) for x in sample] for sample in samples]
        within = statistics.fmean(statistics.pvariance(sample) for sample in logs)
        across = statistics.pvariance([x for sample in logs for x in sample])
        assert within == pytest.approx(0.4**2, rel=0.15) and across == pytest.approx(0.4**2 + 0.5**2, rel=0.15)


def test_a_keyed_length_is_a_pure_function_of_seed_request_and_version():
    a, b = SeededLengths(**PARAMS, seed=1, prompt_key=prompt_of), SeededLengths(**PARAMS, seed=1, prompt_key=prompt_of)
    ids = [f"e0-p{i}-r0" for i in range(20)]
    assert [a(rid, 3) for rid in ids] == [b(rid, 3) for rid in ids]
    assert [a(rid, 3) for rid in ids] != [SeededLengths(**PARAMS, seed=2, prompt_key=prompt_of)(rid, 3) for rid in ids]


def test_without_spread_every_length_is_the_rounded_mean_clipped_and_nothing_is_drawn():
    rng = random.Random(0)
    state = rng.getstate()
    flat = LengthModel(mean_start=100, mean_end=300, response_sigma=0.0, prompt_sigma=0.0, max_len=150, last_version=10)
    assert (flat.draw(rng, 3, 1), flat.draw(rng, 2, 9), rng.getstate() == state) == ([120] * 3, [150] * 2, True)
    assert SeededLengths(**{**PARAMS, "response_sigma": 0.0, "prompt_sigma": 0.0, "max_len": 150})("x-r0", 9) == 150


def test_seeded_lengths_of_engine_request_ids_follow_the_workload_mean_drift_and_shared_prompt_factor():
    """The unclipped mean is the drifting mean at every version (μ is corrected for both sigmas),
    a sample's responses share its prompt factor (they vary less among themselves than across
    samples), and each length is a pure function of (seed, request id, version)."""
    import statistics

    lengths = SeededLengths(mean_start=100, mean_end=300, response_sigma=0.4, prompt_sigma=0.5,
                            max_len=10**9, last_version=10, prompt_key=request_sample_uid)
    ids = [f"e0-p{i}-r{j}" for i in range(600) for j in range(8)]
    for version, mean in ((0, 100), (5, 200), (10, 300), (20, 300)):
        assert statistics.fmean(lengths(rid, version) for rid in ids) == pytest.approx(mean, rel=0.05)
    logs = [[math.log(lengths(f"e0-p{i}-r{j}", 0)) for j in range(8)] for i in range(600)]
    within = statistics.fmean(statistics.pvariance(sample) for sample in logs)
    across = statistics.pvariance([x for sample in logs for x in sample])
    assert within == pytest.approx(0.4**2, rel=0.15) and across == pytest.approx(0.4**2 + 0.5**2, rel=0.15)
    again = SeededLengths(100, 300, 0.4, 0.5, 10**9, 10, prompt_key=request_sample_uid)
    assert [again(rid, 3) for rid in ids[:50]] == [lengths(rid, 3) for rid in ids[:50]]
    assert {SeededLengths(100, 300, 0.0, 0.0, 150, 10)(rid, 5) for rid in ids[:20]} == {150}  # clipped
