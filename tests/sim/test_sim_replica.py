"""A replica as a processor-sharing server: batch-dependent speed, prefill stalls, aborts."""

from __future__ import annotations

import pytest

from sim.replica import Replica, Sample


def make_replica(**kw) -> Replica:
    args = dict(hybrid=False, base_s=1.0, per_seq_s=0.0, speed=1.0, max_num_seqs=8,
                prefill_tokens_per_s=1e12, prompt_tokens=0)
    args.update(kw)
    return Replica(0, **args)


def sample(i: int, lengths: list[int]) -> Sample:
    return Sample(i, lengths, prompt_tokens=0, version=0, now=0.0)


def test_a_sample_finishes_when_its_longest_response_does():
    rep = make_replica()
    s = sample(0, [2, 5, 3])
    rep.add(s, 0.0, resubmit=False)
    assert rep.next_completion() == 2.0
    assert rep.pop_finished(2.0) == []
    assert rep.pop_finished(3.0) == []
    assert rep.next_completion() == 5.0
    assert rep.pop_finished(5.0) == [s]
    assert rep.samples == 0


def test_a_bigger_batch_slows_every_sequence_down():
    # iteration = 1 s + 1 s per running sequence: alone 2 s per token, two together 3 s per token
    rep = make_replica(per_seq_s=1.0)
    rep.add(sample(0, [4]), 0.0, resubmit=False)
    assert rep.next_completion() == 8.0
    rep.add(sample(1, [4]), 2.0, resubmit=False)  # the first has 1 token done, 3 left at 3 s each
    assert rep.next_completion() == pytest.approx(11.0)


def test_sequences_beyond_max_num_seqs_wait_their_turn():
    rep = make_replica(max_num_seqs=1)
    first, second = sample(0, [2]), sample(1, [3])
    rep.add(first, 0.0, resubmit=False)
    rep.add(second, 0.0, resubmit=False)
    assert rep.pop_finished(2.0) == [first]
    assert rep.next_completion() == 5.0


def test_prefill_stalls_decoding_and_a_retry_prefills_what_it_generated():
    rep = make_replica(prefill_tokens_per_s=2.0, prompt_tokens=4)
    s = Sample(0, [10], prompt_tokens=4, version=0, now=0.0)
    assert rep.add(s, 0.0, resubmit=False) == 0  # a first submission re-prefills nothing
    assert rep.next_completion() == 12.0  # 2 s prefill, then 10 tokens
    aborted, requests, tokens = rep.abort(5.0, partial=True)
    assert (aborted, requests, tokens) == ([s], 1, 3)
    assert rep.add(s, 5.0, resubmit=True) == 7  # prompt 4 + 3 generated
    assert rep.next_completion() == 5.0 + 3.5 + 7


def test_without_partial_rollout_an_aborted_response_starts_over():
    rep = make_replica()
    s = sample(0, [10])
    rep.add(s, 0.0, resubmit=False)
    rep.abort(6.0, partial=False)
    rep.add(s, 6.0, resubmit=True)
    assert rep.next_completion() == 16.0


def test_a_paused_replica_makes_no_progress():
    rep = make_replica()
    rep.add(sample(0, [4]), 0.0, resubmit=False)
    rep.advance(1.0)
    rep.paused = True
    rep.advance(10.0)
    assert rep.next_completion() is None
    rep.paused = False
    assert rep.next_completion() == 13.0
