"""Validation: n responses per validation prompt, dealt over the standalone replicas, scored, and
averaged per data_source as `val-core/<data_source>/reward/mean@<n>`."""

from __future__ import annotations

import pytest
from data_support import row

from data.datasets import RLDataset
from data.problems import EOS, CharTokenizer
from data.reward import SampleScorer, score_tidal
from data.types import GenerationResult, SamplingSpec
from data.validation import run_validation, val_sampling, validation_requests

TOK = CharTokenizer()


def dataset() -> RLDataset:
    rows = [row("1+1=", "2"), row("2+2=", "4"), row("c2=", "cc", source="tidal/count")]
    return RLDataset([(f"v:{i}", r) for i, r in enumerate(rows, 1)], TOK, max_prompt_length=12, shuffle=False)


class Replica:
    """Answers "2" to every request, aborting each request's first call when ``abort_first``."""

    def __init__(self, abort_first: bool = False) -> None:
        self.abort_first = abort_first
        self.seen: list[str] = []

    def __call__(self, requests):
        out = []
        for r in requests:
            first = r.request_id not in self.seen
            self.seen.append(r.request_id)
            if self.abort_first and first:
                out.append(GenerationResult(r.request_id, [], [], "abort", 0))
            else:
                out.append(GenerationResult(r.request_id, [*TOK.encode("2", bos=False), EOS], [0.0, 0.0], "stop", 0))
        return out


def scorer(ds: RLDataset) -> SampleScorer:
    return SampleScorer({r.index: (r.data_source, r.ground_truth, r.extra_info) for r in ds.rows}, TOK)


def test_validation_reports_the_mean_reward_per_data_source_at_n():
    ds = dataset()
    a, b = Replica(), Replica(abort_first=True)
    metrics = run_validation(ds, {"standalone-0": a, "standalone-1": b}, scorer(ds), n=2,
                             sampling=val_sampling(max_new_tokens=4, temperature=1.0, top_p=0.9, do_sample=True),
                             tag="3")
    assert metrics == {"val-core/tidal/arith/reward/mean@2": 0.5, "val-core/tidal/count/reward/mean@2": score_tidal("2", "cc")}
    # six requests dealt over two replicas; the aborted ones were sent again
    assert sorted(a.seen + b.seen) == sorted([f"val3-p{p}-r{j}" for p in range(3) for j in range(2)]
                                             + [f"val3-p{p}-r{j}" for p, j in [(0, 1), (1, 1), (2, 1)]])


def test_validation_requests_are_seeded_and_greedy_unless_do_sample():
    ds = dataset()
    spec = val_sampling(max_new_tokens=4, temperature=0.7, top_p=0.5, do_sample=False)
    assert (spec.temperature, spec.top_p) == (0.0, 1.0)
    first = validation_requests(ds, n=1, sampling=spec, tag="1")
    again = validation_requests(ds, n=1, sampling=spec, tag="2")
    assert [r.sampling.seed for r in first] == [r.sampling.seed for r in again]
    assert [(r.request_id, r.prompt_tokens) for r in first] == [
        (f"val1-p{r.index}-r0", list(r.prompt_tokens)) for r in ds.rows]


def test_a_replica_that_keeps_failing_fails_validation_naming_the_request():
    ds = dataset()

    def broken(requests):
        return [ConnectionError("gone") for _ in requests]

    with pytest.raises(RuntimeError) as err:
        run_validation(ds, {"standalone-0": broken}, scorer(ds), n=1, sampling=SamplingSpec(max_new_tokens=2), tag="1")
    assert str(err.value) == "validation request val1-p0-r0 failed on standalone-0: ConnectionError('gone')"


def test_a_replica_that_dies_mid_validation_leaves_its_requests_to_the_others():
    ds = dataset()
    alive, calls = Replica(), []

    def dead(requests):  # a killed replica: its actor call raises
        calls.append([r.request_id for r in requests])
        raise ConnectionError("actor died")

    spec = SamplingSpec(max_new_tokens=2)
    metrics = run_validation(ds, {"standalone-0": dead, "standalone-1": alive}, scorer(ds), n=2, sampling=spec, tag="4")
    assert metrics == run_validation(ds, {"standalone-1": Replica()}, scorer(ds), n=2, sampling=spec, tag="4")
    assert calls == [["val4-p0-r0", "val4-p1-r0", "val4-p2-r0"]]  # asked once, then left out
    assert sorted(alive.seen) == sorted(f"val4-p{p}-r{j}" for p in range(3) for j in range(2))


def test_validation_fails_in_one_line_when_its_last_replica_dies():
    ds = dataset()

    def dead(requests):
        raise ConnectionError("actor died")

    with pytest.raises(RuntimeError) as err:
        run_validation(ds, {"standalone-0": dead}, scorer(ds), n=1, sampling=SamplingSpec(max_new_tokens=2), tag="1")
    assert str(err.value) == ("validation failed: replica standalone-0 failed (ConnectionError('actor died')) "
                              "and no replica is left")
