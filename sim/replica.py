"""A rollout replica as a processor-sharing server, and the samples it serves.

Every running sequence of a replica advances by one token per decode iteration, and an iteration
over ``b`` running sequences takes ``(base_s + per_seq_s × b) / speed`` seconds. So all running
sequences of a replica advance together: the replica keeps one counter ``v`` ("iterations done by
any sequence running since the start") and each sequence finishes when ``v`` reaches its target.
A change of batch size only changes how fast ``v`` grows; the replica's next completion is one
event, re-scheduled (and the old one made stale by ``epoch``) whenever the batch changes.

Prefill stalls decoding: routing a sample to a replica makes it prefill the prompt (once per
sample: its ``n`` responses share it through the prefix cache) and, for a retried sample, the
tokens its unfinished responses generated so far; meanwhile ``v`` does not move. A sequence's
target is ``v_at_admission + tokens_left``. At most ``max_num_seqs`` sequences run; the rest
wait, first come first served, in the replica's own queue.
"""

from __future__ import annotations

import heapq
from collections import deque

# A sequence counts as finished when ``v`` is within this many iterations of its target, or when
# the time left is below the clock's resolution (two ulps of now): without the second rule a
# completion a few ulps away would be re-scheduled at the same instant forever.
_EPS = 1e-6
_CLOCK_ULPS = 4.5e-16


class Sample:
    """One prompt and its ``n`` responses; it finishes when its last response does."""

    __slots__ = ("id", "lengths", "responses", "left", "replica", "started_at", "version", "tokens")

    def __init__(self, sample_id: int, lengths: list[int], prompt_tokens: int, version: int, now: float):
        self.id = sample_id
        self.lengths = lengths
        self.responses = [Response(self, length) for length in lengths]
        self.left = len(lengths)
        self.replica: Replica | None = None
        self.started_at = now
        self.version = version
        self.tokens = prompt_tokens * len(lengths) + sum(lengths)
        """Tokens the trainer trains on for this sample (every response with its prompt)."""


class Response:
    """One generated sequence of a sample."""

    __slots__ = ("sample", "length", "generated", "v_start", "done")

    def __init__(self, sample: Sample, length: int):
        self.sample = sample
        self.length = length
        self.generated = 0
        """Tokens generated before the current submission (kept across partial-rollout aborts)."""
        self.v_start = 0.0
        self.done = False


class Replica:
    """A rollout engine (standalone or hybrid) serving sequences at a batch-dependent speed."""

    __slots__ = (
        "index", "hybrid", "base_s", "per_seq_s", "speed", "max_num_seqs", "prefill_tokens_per_s",
        "prompt_tokens", "running", "waiting", "v", "at", "busy_until", "epoch", "paused", "samples", "_seq",
        "name",
    )

    def __init__(
        self,
        index: int,
        *,
        hybrid: bool,
        base_s: float,
        per_seq_s: float,
        speed: float,
        max_num_seqs: int,
        prefill_tokens_per_s: float,
        prompt_tokens: int,
        name: str = "",
    ):
        self.index = index
        self.name = name or f"{'hybrid' if hybrid else 'standalone'}-{index}"
        """Production's replica id (``standalone-<i>``, ``hybrid-<i>``, each kind counted from 0)."""
        self.hybrid = hybrid
        self.base_s = base_s
        self.per_seq_s = per_seq_s
        self.speed = speed
        self.max_num_seqs = max_num_seqs
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.prompt_tokens = prompt_tokens
        self.running: list[tuple[float, int, Response]] = []  # heap of (target v, seq, response)
        self.waiting: deque[Response] = deque()
        self.v = 0.0
        self.at = 0.0
        self.busy_until = 0.0
        """Decoding is stalled by prefill until then."""
        self.epoch = 0
        """Bumped whenever the next completion time changes; older tick events are stale."""
        self.paused = False
        self.samples = 0
        """Samples routed here and not finished or aborted (the load balancer's load)."""
        self._seq = 0

    def rate(self) -> float:
        """Iterations per second of each running sequence (0 when paused or idle)."""
        b = len(self.running)
        if self.paused or b == 0:
            return 0.0
        return self.speed / (self.base_s + self.per_seq_s * b)

    def advance(self, now: float) -> None:
        """Bring ``v`` up to ``now`` at the current batch size (no progress while prefilling)."""
        at = self.at
        if now > at:
            start = at if at > self.busy_until else self.busy_until
            if now > start and self.running and not self.paused:
                self.v += (now - start) * self.speed / (self.base_s + self.per_seq_s * len(self.running))
            self.at = now

    def next_completion(self) -> float | None:
        """Time of the next sequence completion at the current batch size (None: none pending)."""
        rate = self.rate()
        if rate == 0.0:
            return None
        start = self.at if self.at > self.busy_until else self.busy_until
        left = self.running[0][0] - self.v
        return start + left / rate if left > 0.0 else start

    def prefill(self, now: float, tokens: int) -> None:
        """Stall decoding while ``tokens`` are prefilled (after any prefill already queued)."""
        if tokens > 0:
            self.busy_until = max(self.busy_until, now) + tokens / (self.prefill_tokens_per_s * self.speed)

    def add(self, sample: Sample, now: float, *, resubmit: bool) -> int:
        """Route ``sample``'s unfinished responses here; returns the tokens prefilled again
        (0 for a first submission)."""
        self.advance(now)
        sample.replica = self
        self.samples += 1
        prefill = self.prompt_tokens
        for resp in sample.responses:
            if resp.done:
                continue
            prefill += resp.generated
            if len(self.running) < self.max_num_seqs:
                self._admit(resp)
            else:
                self.waiting.append(resp)
        self.prefill(now, prefill)
        return prefill if resubmit else 0

    def _admit(self, resp: Response) -> None:
        resp.v_start = self.v
        self._seq += 1
        heapq.heappush(self.running, (self.v + resp.length - resp.generated, self._seq, resp))

    def pop_finished(self, now: float) -> list[Sample]:
        """Retire the sequences done by ``now``; returns the samples that finished with them."""
        self.advance(now)
        running = self.running
        slack = self.rate() * abs(now) * _CLOCK_ULPS
        limit = self.v + (slack if slack > _EPS else _EPS)
        finished: list[Sample] = []
        while running and running[0][0] <= limit:
            resp = heapq.heappop(running)[2]
            resp.done = True
            resp.generated = resp.length
            sample = resp.sample
            sample.left -= 1
            if sample.left == 0:
                sample.replica = None
                self.samples -= 1
                finished.append(sample)
        while self.waiting and len(running) < self.max_num_seqs:
            self._admit(self.waiting.popleft())
        return finished

    def abort(self, now: float, *, partial: bool) -> tuple[list[Sample], int, int]:
        """Abort everything here; returns (samples by id, aborted requests, aborted tokens).

        With ``partial`` the tokens generated so far are kept (the retry resumes after them),
        otherwise the retry starts from scratch and they are lost.
        """
        self.advance(now)
        samples: dict[int, Sample] = {}
        aborted_tokens = 0
        for _, _, resp in self.running:
            made = min(resp.length - resp.generated, int(self.v - resp.v_start + _EPS))
            resp.generated += made
            aborted_tokens += resp.generated
            samples[resp.sample.id] = resp.sample
        for resp in self.waiting:
            aborted_tokens += resp.generated
            samples[resp.sample.id] = resp.sample
        aborted = len(self.running) + len(self.waiting)
        if not partial:
            for sample in samples.values():
                for resp in sample.responses:
                    if not resp.done:
                        resp.generated = 0
        self.running.clear()
        self.waiting.clear()
        self.busy_until = min(self.busy_until, now)  # an unfinished prefill is dropped too
        self.samples = 0
        for sample in samples.values():
            sample.replica = None
        return [samples[k] for k in sorted(samples)], aborted, aborted_tokens
