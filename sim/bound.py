"""A lower bound on a simulated run's wall clock that counts the staleness rule and per-sample
latency as well as work (docs/simulator.md, *Lower bound*).

Owns ``lower_bound(spec, result)``: the largest of the fluid bound (all work on all GPUs at the
best speed), the rollout work on the GPUs that can generate, and the *trainer chain*, which
replays the run's micro-steps with every wait cut to what the staleness rule forces. Must not run a simulation or import anything of ours beyond
``sim.spec`` and ``sim.result``: it is a pure function of a spec and a finished run's samples.

The chain rests on one fact of DESIGN §5's gate: after the sync that ends step ``k`` (at ``E_k``)
the rollouter has started at most ``k·B + M`` samples until the next sync (``B`` = samples per
step, ``M`` = ``max_required_samples``), so a sample whose start index exceeds ``(k−1)·B + M``
starts after ``E_k``. The micro-step that needs the ``N``-th finished sample therefore waits until
``E_k`` plus the time the ``c = N − (k−1)·B − M`` samples that started after ``E_k`` need at least:
the c-th shortest latency among the candidates (prompt prefill + longest response × the fastest
iteration of one sequence) and their c cheapest works spread over every GPU that can generate.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.result import SimResult
from sim.spec import SimSpec

WINDOW = 3
"""Syncs looked back per micro-step (any subset of the constraints keeps the bound valid; older
syncs lie so far back that they never bind on the presets)."""


@dataclass(frozen=True)
class Bound:
    """The two lower bounds of one run, in virtual seconds."""

    fluid_s: float
    """(rollout + train GPU-seconds) / total GPUs (``SimResult.fluid_bound_s``)."""
    rollout_s: float
    """Rollout GPU-seconds / the GPUs that can generate (the standalone ones without hybrids)."""
    chain_s: float
    """The trainer's compute, syncs and fixed overheads plus every wait the staleness rule forces."""

    @property
    def lower_bound_s(self) -> float:
        return max(self.fluid_s, self.rollout_s, self.chain_s)

    @property
    def binding(self) -> str:
        """Which one is the largest: ``fluid``, ``rollout`` or ``staleness``."""
        best = self.lower_bound_s
        return "staleness" if self.chain_s == best else "rollout" if self.rollout_s == best else "fluid"


def _kinds(spec: SimSpec) -> list[tuple[float, int]]:
    """``(speed, max_num_seqs)`` of the replica kinds the spec has."""
    kinds = []
    if spec.standalone_replicas:
        kinds.append((1.0, spec.max_num_seqs))
    if spec.hybrid_replicas:
        kinds.append((spec.hybrid_throughput_factor, spec.hybrid_max_num_seqs or spec.max_num_seqs))
    return kinds


def best_iteration_s(spec: SimSpec) -> float:
    """Seconds per token of one sequence alone on the fastest replica kind."""
    per_token = (spec.decode_step_base_s + spec.decode_step_per_seq_s) / spec.speculative_speedup
    return min(per_token / speed for speed, _ in _kinds(spec))


def best_token_gpu_s(spec: SimSpec) -> float:
    """GPU-seconds per decoded token on the kind that is cheapest at its full batch."""
    mtp = spec.speculative_speedup
    base, per_seq = spec.decode_step_base_s / mtp, spec.decode_step_per_seq_s / mtp
    return min((base + per_seq * m) / (m * speed) for speed, m in _kinds(spec)) * spec.gpus_per_replica


def _best_speed(spec: SimSpec) -> float:
    return max(speed for speed, _ in _kinds(spec))


def sample_latency_s(spec: SimSpec, longest: int) -> float:
    """Least seconds from a sample's start to its end: its prompt's prefill, then its longest
    response at the fastest single-sequence iteration."""
    return spec.prompt_tokens / (spec.prefill_tokens_per_s * _best_speed(spec)) + longest * best_iteration_s(spec)


def sample_work_gpu_s(spec: SimSpec, tokens: int) -> float:
    """Least GPU-seconds to generate a sample of ``tokens`` trained tokens (its decode at the best
    full-batch cost plus one prompt prefill), as the fluid bound counts it."""
    decode = tokens - spec.prompt_tokens * spec.n
    prefill = spec.prompt_tokens / (spec.prefill_tokens_per_s * _best_speed(spec)) * spec.gpus_per_replica
    return decode * best_token_gpu_s(spec) + prefill


def _generating_gpus(spec: SimSpec) -> int:
    """GPUs that may generate at some moment: all of them when the trainer can lend its own."""
    return spec.total_gpus if spec.hybrid_replicas else spec.standalone_gpus


def _compute_s(spec: SimSpec, tokens: list[int]) -> float:
    """One micro-step's training time (the simulator's cost model)."""
    return spec.train_step_overhead_s + sum(tokens) / (spec.trainer_gpus * spec.train_tokens_per_gpu_s)


def chain_bound_s(spec: SimSpec, result: SimResult, window: int = WINDOW) -> float:
    """The trainer chain: each micro-step starts no earlier than its task, the previous update and
    the staleness wait; each step adds its broadcast and the fixed control-plane costs."""
    r, b, m_cap = spec.required_samples, spec.step_required_samples, spec.max_required_samples
    tau = spec.task_overhead_s
    steps = len(result.trained_ids) // b
    ids = result.trained_ids
    latency = {i: sample_latency_s(spec, n) for i, n in zip(ids, result.trained_longest)}
    work = {i: sample_work_gpu_s(spec, n) for i, n in zip(ids, result.trained_tokens)}
    gpus = _generating_gpus(spec)
    sync_end = [0.0]  # E_0 = 0: version 0 starts with the run
    t = 0.0
    for j in range(1, steps + 1):
        last_id = (j - 1) * b + m_cap  # samples trained in step j started before E_j
        windows = []
        for k in range(max(0, j - window), j):
            first_id = (k - 1) * b + m_cap if k else 0  # after E_k start only ids >= this
            cands = [i for i in range(first_id, last_id) if i in latency]
            works = sorted(work[i] for i in cands)
            prefix = [0.0]
            for w in works:
                prefix.append(prefix[-1] + w)
            windows.append((k, first_id, sorted(latency[i] for i in cands), prefix))
        for micro in range(spec.trigger_parameter_sync_step):
            need = (j - 1) * b + (micro + 1) * r
            ready = 0.0
            for k, first_id, lats, prefix in windows:
                c = min(need - first_id, len(lats))
                if c >= 1:
                    ready = max(ready, sync_end[k] + max(lats[c - 1], prefix[c] / gpus))
            q = (j - 1) * spec.trigger_parameter_sync_step + micro
            t = max(t + tau, ready) + _compute_s(spec, result.trained_tokens[q * r:(q + 1) * r])
        t += tau + spec.broadcast_sync_s
        sync_end.append(t)
        asks_lend = spec.hybrid_replicas > 0 and j < steps
        t += tau * (2 if asks_lend else 1) + spec.step_overhead_s  # [ShouldActivate], UpdateAfterStep, Commit
    return t


def lower_bound(spec: SimSpec, result: SimResult, window: int = WINDOW) -> Bound:
    """Both lower bounds of ``result`` (a run of ``spec``): no schedule that trains the same
    samples in the same micro-steps under the same staleness rule finishes before either."""
    return Bound(
        fluid_s=result.fluid_bound_s,
        rollout_s=result.rollout_gpu_s / _generating_gpus(spec),
        chain_s=chain_bound_s(spec, result, window),
    )
