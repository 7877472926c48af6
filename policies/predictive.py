"""`predictive`: lend k of the m hybrids after a sync only when a model of the next cycle says it wins.

Owns the cycle model of ``docs/policies.md``. From the no-lend cycles it has seen (``ctx.now`` at
each ``update_after_step``) it measures the cycle time ``T0`` and the trainer's wait ``W``; from the
lending cycles the switch seconds ``C``; from the context at the sync the staleness headroom
(cap − in flight − queued) and the standalones' in-flight samples. Lending k hybrids adds a share
ρ_k = min(k / S, headroom / in flight) to the standalones' generation while they are lent, and
(fluid model) shortens the cycle by ρ_k (W − C) / (1 + ρ_k). Three things the fluid model leaves
out are measured or bounded too (``docs/policies.md``, *What the cycle model missed*): a sample
started on a lent hybrid finishes only after a sample's latency L (Little's law: in flight × T0 /
N), so a lend window D shorter than L delivers only D / L of ρ_k; the run's prompt budget bounds
what can still start; and what a lending streak measured against the no-lend cycles on both sides
of it (it pauses after its first streak to measure that) is believed over the model.
A clear win (the hybrids add at least the standalones' share and even the smallest recent wait
pays the switches) is lent from the first step, with no measurement first and no pause after its
first streak, and each re-measurement that confirms it makes the next one ``TRUST_GROWTH`` times
further away; where only the switch-cost prior stands between the model and a lend, one probe lend
measures the switches (after two no-lend cycles) if the run is long enough to afford it. Before
the load of a filled replica is measured, the headroom the rollouter left unstarted says whether
the lent hybrids are full (no rebalance).
It lends the k with the largest predicted gain when that gain clears its uncertainty and a margin,
and re-measures ``T0`` and ``W`` sooner when the win it lends on is marginal. The samples to queue
before taking the hybrids back start from the same model and adapt to the trainer's waits after
the take-back. Must not: read the clock, do I/O, or change state anywhere but ``update_after_step``
(the questions are pure functions of the state and the context).
"""

from __future__ import annotations

import math
from typing import Any

from policies.base import DynamicScheduleContext, DynamicSchedulePolicyBase
from policies.builtin import check_ratio
from policies.registry import register_policy

EMA_ALPHA = 0.3
"""Weight of a new cycle in the running means (after the first 1/alpha cycles, a plain mean)."""
MIN_BASE_CYCLES = 5
"""No-lend cycles to measure before the model is trusted."""
MIN_PROBE_CYCLES = 2
"""…but a probe of the switch seconds needs only this many: it asks whether free switches would
win, and what it measures (C) is what the first lends' answers turn on most."""
START_UP_STEPS = 2
"""Cycles ending at these first steps are not measured: the rollouter started every sample at
once, so their waits are the start-up's, not the run's."""
REFRESH_EVERY = 48
"""While lending, pause for ``PROBE_PAUSE`` steps after this many lends, to re-measure ``T0`` and
``W`` and what the streak gave…"""
REFRESH_MARGINAL = 6
"""…or after this many when the win is marginal (W < ``MARGINAL`` × C_k, or the last streak gave
less than C_k): a drift of ``W`` (responses getting shorter) turns a small win into a loss soonest."""
MARGINAL = 2.0
MIN_LENT_CYCLES = 2
"""Lend cycles (lent at both ends) of a lending streak that are compared with the no-lend cycles
around it…"""
AROUND = 2
"""…the last this many before the streak and the first this many after it (an A-B-A comparison:
a drift of T0 shows on both sides and cancels, where a trend extrapolated over the streak does not)."""
ABA_MAX = 6
"""A streak of more lend cycles than this is compared with the no-lend cycles after it only: its
lend cycles' mean follows the latest (``EMA_ALPHA``), and what was measured before it may lie a
long drift ago (the seed preset's cycles grow from 35 s to 65 s over a streak of 350 steps)."""
PROBE_PAUSE = AROUND + 1
"""Steps without lending after the first measured streak: the take-back cycle and ``AROUND``
no-lend cycles, so what lending gave is measured before lending goes on."""
REALIZED_FOR = 8
"""What a streak gave caps the model until this many no-lend cycles were measured after it (then
the model may try again, and the next streak is measured anew)."""
Z = 1.0
"""Standard errors a predicted win must clear."""
MARGIN = 0.02
"""…and a share of ``T0`` it must clear too: what the fluid model leaves out (aborted and
re-prefilled work at the switches, the long tail of a sample's responses)."""
SWITCH_MARGIN = 0.1
"""…and this share of the switch seconds C_k: the switches are partly on the trainer's path where
the lend window is shorter than a sample's latency (random draw #67 of ``draw(200, 2, 16)``:
switches of 13.7 s, a predicted win of 1.3 s, a lend that lost)."""
TREND_BETA = 0.2
"""Share of a no-lend cycle's surprise that goes into the per-step slope."""
PRIOR_SWITCH_S = 6.0
"""Switch seconds per lend cycle (sync + activate + rebalance + deactivate) before one is measured
(``prior_switch_s``, config key ``async_training.dynamic_schedule_prior_switch_s``)."""
CLEAR_GAIN = 1.0
"""A lend is a clear win, lent without measuring ``T0`` first and without the pause that measures
its streak, when the fluid gain from the most pessimistic recent wait, ρ_k (W_min − C_k) / (1 + ρ_k),
is at least this many times the switch seconds C_k…"""
CLEAR_SHARE = 1.0
"""…and the k hybrids add at least this share of the standalones' generation (ρ_k ≥ 1: the
layouts with as many hybrid as standalone GPUs or more, where the standalones alone are slowest)."""
CLEAR_TRUST = 8
"""A clear win is re-measured after ``REFRESH_EVERY`` × (its pessimistic gain / its bar) lends, at
most this many times ``REFRESH_EVERY``: the further the wait is above what the lend needs, the
longer a drift takes to turn the win into a loss."""
TRUST_GROWTH = 16
"""Each measured streak in a row that confirms a clear win (it gave at least the clear bar) makes
the lends before the next re-measuring this many times as many: a win measured again and again
is trusted for longer (the lend cycles still watch for a shrinking wait, ``lend_drift_s``)."""
LEND_REF = 2
"""Lend cycles of a streak whose mean is the reference its later cycles are compared with: W_min
of a clear win is lowered by (1 + ρ) × how much shorter they have become (a clear win lent for
long is judged on waits measured before it, and shrinking responses shrink the wait)."""
DRIFT_FACTOR_MAX = 2.0
DRIFT_NOISE = 0.05
"""A streak's lend cycles count as shorter only beyond this share of its first ones (noise)."""
CLEAR_WINDOW = 3
"""No-lend waits kept for W_min: the last this many cycles that did not begin with a take-back
(the start-up's included: a wait that is large from step 1 on is what makes a win clear)."""
PROBE_GAIN = 0.25
"""A probe is asked only where free switches would give at least this share of the prior a cycle."""
PROBE_WORST = 1.0
"""A probe (one lend to measure the switches when only the prior keeps the model from lending)
assumes it may cost this many times ``prior_switch_s`` (plus ``MARGIN`` of T0), with none of it
hidden in the wait: a lend window shorter than a sample's latency hides little (random draw #9 of
``draw(200, 1)``: switches of 12.3 s under a 14 s wait lengthened the probe's cycle by 7.6 s)…"""
FIRST_LEND_TRUST = 2.0
"""Before any switch is measured, a lend the model predicts is made outside the probe budget only
if its predicted gain is this many times what a probe may cost: with the switches unknown the
model's gain is least known (random draw #147 of ``draw(200, 5, 16)``, 28 hybrids beside two
standalones at staleness 0 with switches ×2.7: a predicted 10 s against a 6.8 s probe cost, a
measured 9.6 s of switches and no gain, +2.4 % against never lending over 16 steps)."""
PROBE_BUDGET = 0.006
"""…which must be under this share of the run's predicted no-lend wall clock (T0 × its steps):
the promise is 1 %, and a short run cannot afford a probe at all."""
RATIO_GAIN, RATIO_UP_MIN, RATIO_UP_MAX, RATIO_DOWN = 0.5, 0.01, 0.25, 0.02
"""Queue-share adaptation after a lend cycle: up by ``RATIO_GAIN`` × the waited-for share of the
cycle (clipped), down by a fixed step when the trainer did not wait after the take-back. A wait
says how far below the point where waiting starts the share is, but that point moves from cycle
to cycle: going all the way (gain 1) overshoots. On the seed preset with the overlapped sync
(seeds 0-4) gain 1 took 5.432 h capped at 0.1 and 5.473 h capped at 0.5, gain 0.5 5.416 h (a
fixed share of 0.42, known in hindsight, 5.386 h); the cap of 0.25 lets a layout far below the
point (26 hybrids beside one standalone, random draw #98 of ``draw(200, 0, 16)``) climb in a few
cycles (``docs/policies.md``)."""


def _weight(n: int) -> float:
    """Weight of the n-th value in a running mean: 1 / n, exponential (``EMA_ALPHA``) after 1/alpha."""
    return max(EMA_ALPHA, 1.0 / n)


def _effective_n(n: float) -> float:
    """How many values a running mean of n is worth (the exponential window caps it)."""
    return min(n, 2.0 / EMA_ALPHA - 1.0)


def _stat() -> dict[str, float]:
    return {"n": 0, "mean": 0.0, "var": 0.0}


def _add(stat: dict[str, float], x: float) -> dict[str, float]:
    """A new stat with ``x`` folded in: running mean and variance, exponential after 1/alpha."""
    n = stat["n"] + 1
    w = _weight(n)
    delta = x - stat["mean"]
    return {"n": n, "mean": stat["mean"] + w * delta, "var": (1.0 - w) * (stat["var"] + w * delta * delta)}


def _se(stat: dict[str, float]) -> float:
    """Standard error of a stat's mean (its effective sample size is capped by the EMA window)."""
    if stat["n"] <= 0:
        return math.inf
    return math.sqrt(max(stat["var"], 0.0) / _effective_n(stat["n"]))


def _book(book: dict[str, dict[str, float]], k: int, seconds: float) -> dict[str, dict[str, float]]:
    """``book`` with ``seconds`` folded in under ``k`` and under "any"."""
    return {**book, **{key: _add(book.get(key, _stat()), seconds) for key in (str(k), "any")}}


def _streak(before: float = 0.0) -> dict[str, Any]:
    """A lending streak to measure: the mean of the no-lend cycles before it, its cycles lent at
    both ends, and the no-lend cycles after its take-back."""
    return {"before": before, "lent": _stat(), "after": _stat()}


def _trend() -> dict[str, float]:
    return {"n": 0, "level": 0.0, "slope": 0.0, "step": 0, "var": 0.0}


def _trend_at(trend: dict[str, float], step: int) -> float:
    """The trend's value at ``step`` (level plus slope times the steps since its last sample)."""
    return trend["level"] + trend["slope"] * (step - trend["step"])


def _trend_add(trend: dict[str, float], step: int, x: float) -> dict[str, float]:
    """Holt's linear smoothing: the no-lend cycle drifts (responses grow), so a plain mean lags."""
    if trend["n"] == 0:
        return {"n": 1, "level": x, "slope": 0.0, "step": step, "var": 0.0}
    gap = max(1, step - trend["step"])
    err = x - _trend_at(trend, step)
    w = _weight(trend["n"] + 1)
    return {
        "n": trend["n"] + 1,
        "level": _trend_at(trend, step) + w * err,
        "slope": trend["slope"] + TREND_BETA * w * err / gap,
        "step": step,
        "var": (1.0 - w) * (trend["var"] + w * err * err),
    }


def unstarted_headroom(ctx: DynamicScheduleContext) -> int:
    """Samples the rollouter could still start under the staleness cap (cap − in flight − queued),
    no more than the prompts left to start. Right after a lend the rollouter has started all it
    may, so headroom left over means the replicas' concurrency, not the cap, stopped it."""
    headroom = max(0, ctx.max_required_samples - ctx.in_flight_samples - ctx.mq_size)
    return headroom if ctx.samples_to_start is None else min(headroom, ctx.samples_to_start)


def hybrid_share(k: int, ctx: DynamicScheduleContext) -> float:
    """ρ_k: what k lent hybrids add to the standalones' generation, as a share of it.

    k / S if the hybrids run as many samples each as a standalone does now, but never more than
    the staleness headroom lets start: (cap − in flight − queued) / in flight. With no headroom
    the hybrids can only take over samples already running, which adds no throughput.
    """
    if k <= 0:
        return 0.0
    s = max(1, ctx.standalone_replicas)
    if ctx.max_required_samples <= 0 or ctx.in_flight_samples <= 0:
        return k / s  # nothing to bound it with (a bare context)
    return min(k / s, unstarted_headroom(ctx) / ctx.in_flight_samples)


@register_policy("predictive")
class PredictiveDynamicSchedulePolicy(DynamicSchedulePolicyBase):
    """Lends k of the m hybrids after a sync only when the predicted cycle time says it wins.

    ``deactivate_ratio`` is ignored but for only-hybrid runs (forced to 1.0, like the built-ins);
    the share of a cycle to queue before taking the hybrids back comes from the model (``ratio``).
    """

    def __init__(self, deactivate_ratio: float = 0.0, only_hybrid: bool = False,
                 prior_switch_s: float = PRIOR_SWITCH_S, clear_gain: float = CLEAR_GAIN,
                 probe_budget: float = PROBE_BUDGET, probes: bool = True):
        self.deactivate_ratio = 1.0 if only_hybrid else check_ratio(deactivate_ratio)
        self.only_hybrid = bool(only_hybrid)
        if not prior_switch_s > 0:
            raise ValueError(f"prior_switch_s: must be > 0 (got {prior_switch_s})")
        if not clear_gain > 0 or probe_budget < 0:
            raise ValueError(f"clear_gain must be > 0 and probe_budget >= 0 (got {clear_gain}, {probe_budget})")
        self.prior_switch_s = float(prior_switch_s)
        """Switch seconds of a lend cycle assumed until one is measured (half for each part)."""
        self.clear_gain = float(clear_gain)
        """``CLEAR_GAIN`` (``math.inf``: no clear wins, every lend is measured first)."""
        self.probe_budget = float(probe_budget)
        """``PROBE_BUDGET``: the share of the run a lend with unmeasured switches may risk."""
        self.probes = bool(probes)
        """False: never probe (the prior alone decides whether a first lend is tried)."""
        self.last_end_at: float | None = None
        """``ctx.now`` at the previous ``update_after_step`` (a cycle runs from one to the next)."""
        self.last_lent = 0
        """Hybrids lent at the end of the previous cycle."""
        self.base = _trend()
        """Seconds of a cycle that neither began nor ended with a lend, as a drifting trend (``T0``)."""
        self.wait = _stat()
        """Trainer wait seconds in those cycles (``W``)."""
        self.activate: dict[str, dict[str, float]] = {}
        """Measured activation seconds (hybrid sync + activate + rebalance) per k lent (a string,
        for JSON), and under "any" for every k: the first half of ``C_k``."""
        self.deactivate: dict[str, dict[str, float]] = {}
        """Measured take-back seconds, the same way: the second half of ``C_k``."""
        self.ratio: float | None = None
        """Share of a cycle to queue before the take-back; None until the first lend cycle ends."""
        self.load = _stat()
        """Samples in flight per standalone replica after no-lend cycles: what a filled replica holds."""
        self.lends_since_refresh = 0
        self.pause_left = 0
        """Steps still to skip lending while re-measuring ``T0`` and ``W``."""
        self.recent: list[float] = []
        """The last ``AROUND`` no-lend cycles' seconds (the "before" of the next streak)."""
        self.streak = _streak()
        """The lending streak being measured: the no-lend cycles before it (mean), the cycles lent
        at both ends, and the no-lend cycles after its take-back."""
        self.realized: dict[str, float] | None = None
        """Seconds the measured streaks' cycles were shorter than the no-lend cycles around them,
        each clipped to [−C, W], as a running mean (``gain``, over ``n`` streaks), and the no-lend
        samples there were at the latest (``base_n``): what lending really gave."""
        self.free_waits: list[float] = []
        """The trainer's wait in the last ``CLEAR_WINDOW`` cycles that did not begin with a take-back
        (from step 1 on): W_min of the clear-win test."""
        self.clear = False
        """The latest lend was a clear win (no A-B-A pause after its first streak)."""
        self.clear_margin = 0.0
        """The latest clear win's pessimistic gain over its bar (``refresh_after``)."""
        self.confirmed = 0
        """Measured streaks in a row that gave a clear win's bar or more (``TRUST_GROWTH``)."""
        self.lend_ref: float | None = None
        """Mean of the current streak's first ``LEND_REF`` lend cycles (``lend_drift_s``)."""
        self.marginal = False
        """At the latest lend, W was under ``MARGINAL`` × the switch seconds of what it lent, or the
        last streak gave less than them."""

    # ------------------------------------------------------------------ the model

    def switch_parts(self, k: int | None = None) -> list[dict[str, float]]:
        """The activation and take-back stats for lending k: measured with k, else with any k."""
        parts = []
        for book in (self.activate, self.deactivate):
            stat = book.get(str(k)) or book.get("any")
            parts.append(stat if stat and stat["n"] else _stat())
        return parts

    def switch_s(self, k: int | None = None) -> float:
        """``C_k``: the switch seconds of one lending cycle (half the prior for a part not measured)."""
        return sum(p["mean"] if p["n"] else self.prior_switch_s / 2 for p in self.switch_parts(k))

    def _part_se(self, part: dict[str, float]) -> float:
        """Standard error of one switch part's mean: a part never measured is only its prior (half
        of ``prior_switch_s``), known to no better than its own size; one measurement has no spread."""
        if not part["n"]:
            return self.prior_switch_s / 2
        return _se(part) if part["n"] > 1 else 0.0

    def latency_s(self, ctx: DynamicScheduleContext) -> float:
        """L: a sample's seconds from start to finish in a no-lend cycle, by Little's law (samples
        in flight / samples finished per second = load × S × T0 / N); 0 until measured."""
        if not self.load["n"] or self.base["level"] <= 0:
            return 0.0
        in_flight = self.load["mean"] * max(1, ctx.standalone_replicas)
        return in_flight * self.base["level"] / max(1, ctx.step_required_samples)

    def effective_share(self, k: int, ctx: DynamicScheduleContext, switch_s: float | None = None) -> float:
        """ρ_k as far as the lend window lets it count: the hybrids generate for D = (W − C_k) /
        (1 + ρ_k) seconds before the take-back, and a sample started there needs L; what is not
        done by then goes back, part-done, to the standalones (re-prefilled). So ρ_k × min(1, D / L)
        (``switch_s`` for C_k when given)."""
        rho = hybrid_share(k, ctx)
        latency = self.latency_s(ctx)
        window = (self.wait["mean"] - (self.switch_s(k) if switch_s is None else switch_s)) / (1.0 + rho)
        if rho <= 0 or latency <= 0 or window <= 0:
            return rho  # a lend that cannot pay its switches loses them whatever the hybrids do
        return rho * min(1.0, window / latency)

    def gain_s(self, k: int, ctx: DynamicScheduleContext) -> tuple[float, float]:
        """(seconds lending k shortens the next cycle by, its standard error): ρ (W − C_k) / (1 + ρ)
        with ρ the effective share."""
        rho = self.effective_share(k, ctx)
        share = rho / (1.0 + rho)
        se_c = math.hypot(*(self._part_se(p) for p in self.switch_parts(k)))
        # a streak whose lend cycles keep shrinking says W shrank under it: (1 + ρ_k) × as much
        wait = self.wait["mean"] + self.drift_factor(hybrid_share(k, ctx)) * self.lend_drift_s()
        return share * (wait - self.switch_s(k)), share * math.hypot(_se(self.wait), se_c)

    def predictions(self, step: int, ctx: DynamicScheduleContext) -> dict[int, tuple[float, float]]:
        """k → (predicted seconds of cycle ``step``, uncertainty) for k = 0 (no lend) … m."""
        base = _trend_at(self.base, step)
        base_se = math.sqrt(max(self.base["var"], 0.0) / max(1.0, _effective_n(self.base["n"])))
        out = {0: (base, base_se)}
        realized = self.realized_gain_s(step)
        for k in range(1, max(1, ctx.hybrid_replicas) + 1):
            gain, se = self.gain_s(k, ctx)
            if realized is not None and realized < gain:  # the measurement is believed, with its error
                gain, se = realized, self.realized.get("se", 0.0)
            out[k] = (base - gain, se)
        return out

    def realized_gain_s(self, step: int) -> float | None:
        """What the last measured streak gave, until ``REALIZED_FOR`` no-lend cycles were measured
        after it: a win the model promises and the cycles do not show is not believed."""
        if not self.realized or "gain" not in self.realized:  # none yet (or a state saved before streaks)
            return None
        if self.base["n"] - self.realized["base_n"] >= REALIZED_FOR:
            return None
        return self.realized["gain"]

    def best_lend(self, step: int, ctx: DynamicScheduleContext) -> int:
        """The k whose predicted gain is largest (ties: the larger k) if it clears Z standard
        errors plus ``MARGIN`` of ``T0``; else 0."""
        if self.base["n"] < MIN_BASE_CYCLES or self.wait["n"] < MIN_BASE_CYCLES:
            return 0
        preds = self.predictions(step, ctx)
        t0 = preds[0][0]
        k = min(range(1, len(preds)), key=lambda j: (round(preds[j][0], 9), -j))
        gain, se = t0 - preds[k][0], preds[k][1]
        if not gain > Z * se + MARGIN * t0 + SWITCH_MARGIN * self.switch_s(k):
            return 0
        # before any switch is measured the first lend risks the prior's switch on the path, as a
        # probe does: only where the run can afford that, or the win pays it anyway
        if not self.activate and gain < FIRST_LEND_TRUST * self.probe_cost_s() and not self.affords_probe(step, ctx):
            return 0
        return k

    def win_bar_s(self, k: int | None = None) -> float:
        """What a lend of k must shorten a cycle by beyond its uncertainty to count as a win:
        ``MARGIN`` of T0 and ``SWITCH_MARGIN`` of C_k (``best_lend``'s bar; a measured streak that
        gave less is marginal, one that gave it confirms the win)."""
        return MARGIN * self.base["level"] + SWITCH_MARGIN * self.switch_s(k)

    def probe_cost_s(self) -> float:
        """What a lend with unmeasured switches may cost: ``PROBE_WORST`` × the prior + ``MARGIN`` of T0."""
        return PROBE_WORST * self.prior_switch_s + MARGIN * self.base["level"]

    def affords_probe(self, step: int, ctx: DynamicScheduleContext) -> bool:
        """``probe_cost_s`` is under ``probe_budget`` of the run's predicted no-lend wall clock."""
        return self.probe_cost_s() <= self.probe_budget * self.base["level"] * self.run_steps(step, ctx)

    def recent_waits(self, ctx: DynamicScheduleContext) -> list[float]:
        """The last ``CLEAR_WINDOW`` no-lend waits, this step's among them when it began unlent
        (asked before ``update_after_step`` books it)."""
        if self.last_lent:
            return list(self.free_waits)
        return (self.free_waits + [float(sum(ctx.step_wait_times))])[-CLEAR_WINDOW:]

    def clear_gain_s(self, k: int, ctx: DynamicScheduleContext, rho: float | None = None,
                     waits: list[float] | None = None) -> float:
        """The pessimistic fluid gain of lending k: ρ_k (W_min − C_k) / (1 + ρ_k), with W_min the
        smallest recent no-lend wait; 0 if ρ_k is under ``CLEAR_SHARE`` or nothing was measured."""
        rho = hybrid_share(k, ctx) if rho is None else rho
        waits = self.recent_waits(ctx) if waits is None else waits
        if not waits or rho < CLEAR_SHARE:
            return 0.0
        return rho * (min(waits) + self.drift_factor(rho) * self.lend_drift_s() - self.switch_s(k)) / (1.0 + rho)

    @staticmethod
    def drift_factor(rho: float) -> float:
        """1 + ρ (the fluid model's ΔW per second of lend cycle), at most ``DRIFT_FACTOR_MAX``:
        with many hybrids per standalone a lend cycle's noise would otherwise swamp W."""
        return min(1.0 + rho, DRIFT_FACTOR_MAX)

    def _lent_share(self, lent: int, ctx: DynamicScheduleContext) -> float:
        """ρ of a lend just made, from the context after it (``update_after_step``): k / S, bounded
        by the headroom the standalones' usual load (``load``, once measured) leaves under the cap,
        as ``hybrid_share`` bounded it at the question (the in-flight count now has the lent
        hybrids' samples in it)."""
        s = max(1, ctx.standalone_replicas)
        rho = lent / s
        if self.load["n"] and ctx.max_required_samples > 0:
            held = self.load["mean"] * s
            rho = min(rho, max(0.0, ctx.max_required_samples - held - ctx.mq_size) / max(held, 1e-9))
        return rho

    def lend_drift_s(self) -> float:
        """How much shorter the current streak's lend cycles have become since its first
        ``LEND_REF``, beyond ``DRIFT_NOISE`` of them (≤ 0): the fluid lend cycle is B + W / (1 + ρ)
        + …, so a wait that shrank by ΔW (responses getting shorter while the streak runs) shows as
        ΔW / (1 + ρ) there."""
        if self.lend_ref is None or self.streak["lent"]["n"] <= LEND_REF or self.streak["after"]["n"]:
            return 0.0
        return min(0.0, self.streak["lent"]["mean"] - (1.0 - DRIFT_NOISE) * self.lend_ref)

    def clear_lend(self, step: int, ctx: DynamicScheduleContext) -> int:
        """The k with the largest clear-win gain (ties: the larger k) if it is at least
        ``CLEAR_GAIN`` × C_k and no measured streak says lending gives less than that; else 0."""
        realized = self.realized_gain_s(step)
        best, best_gain = 0, 0.0
        for k in range(1, max(1, ctx.hybrid_replicas) + 1):
            c = self.switch_s(k)
            gain = self.clear_gain_s(k, ctx)
            if gain >= self.clear_gain * c and (realized is None or realized >= self.clear_gain * c) and gain >= best_gain:
                best, best_gain = k, gain
        return best

    def run_steps(self, step: int, ctx: DynamicScheduleContext) -> float:
        """The run's steps as far as the context tells: ``step`` and what the samples still to
        start, in flight and queued make; infinite for a run without a prompt budget."""
        if ctx.samples_to_start is None:
            return math.inf
        left = ctx.samples_to_start + ctx.in_flight_samples + ctx.mq_size
        return step + left / max(1, ctx.step_required_samples)

    def probe_lend(self, step: int, ctx: DynamicScheduleContext) -> int:
        """All m hybrids once, to measure the switches, when no switch was ever measured, the
        model is trusted, lending would win if the switches were free (ρ W / (1 + ρ) ≥ ``PROBE_GAIN``
        × the prior)
        and the run can afford switches of ``PROBE_WORST`` × the prior (``PROBE_BUDGET``); else 0."""
        if (self.activate or not self.probes or self.base["n"] < MIN_PROBE_CYCLES
                or self.wait["n"] < MIN_PROBE_CYCLES):
            return 0
        m = max(1, ctx.hybrid_replicas)
        rho = self.effective_share(m, ctx, switch_s=0.0)
        if rho * self.wait["mean"] / (1.0 + rho) < PROBE_GAIN * self.prior_switch_s:
            return 0
        return m if self.affords_probe(step, ctx) else 0

    def refresh_after(self, run_steps: float = math.inf) -> int:
        """Lends before the next pause to re-measure: ``REFRESH_MARGINAL`` for a marginal win;
        for a model's win ``REFRESH_EVERY``, but no more than a quarter of the run's steps (a
        streak measured wrong must not be believed for most of a short run); up to
        ``CLEAR_TRUST`` × ``REFRESH_EVERY`` for a clear one (``clear_margin``: its pessimistic gain
        over its bar at the latest lend), times ``TRUST_GROWTH`` for each measured streak in a row
        that confirmed it (a model's win is not trusted longer: its streaks are not clear enough
        to tell a shrinking wait from noise within a short run)."""
        if self.marginal:
            return REFRESH_MARGINAL
        if self.clear:
            trust = TRUST_GROWTH ** min(self.confirmed, 4)
            return int(REFRESH_EVERY * min(CLEAR_TRUST, max(1.0, self.clear_margin)) * trust)
        return int(max(REFRESH_MARGINAL, min(REFRESH_EVERY, run_steps / 8)))

    def model_ratio(self, ctx: DynamicScheduleContext) -> float:
        """Share of the cycle to queue so that the trainer no longer waits after the take-back
        (fluid): all of it but what the standalones make while the last micro-step's turn comes,
        (take-back + (m − 1)/m of the busy seconds) × N / T0."""
        t0 = self.base["level"]
        if t0 <= 0:
            return 0.5
        m = max(1, ctx.trigger_parameter_sync_step)
        busy = max(0.0, t0 - self.wait["mean"])
        return min(1.0, max(0.0, 1.0 - (self.switch_s() / 2 + busy * (m - 1) / m) / t0))

    def _lends_now(self, step: int, ctx: DynamicScheduleContext) -> int:
        if self.only_hybrid:
            return max(1, ctx.hybrid_replicas)
        if self.pause_left > 0:
            return 0
        return self.clear_lend(step, ctx) or self.best_lend(step + 1, ctx) or self.probe_lend(step, ctx)

    # ------------------------------------------------------------------ hooks

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        """``ratio`` × the cycle's samples: at least one micro-step's worth, at most the staleness cap."""
        cycle = ctx.step_required_samples
        if self.only_hybrid:
            return cycle
        ratio = self.model_ratio(ctx) if self.ratio is None else self.ratio
        q = max(ctx.required_samples, min(cycle, int(round(cycle * ratio))))
        return min(q, ctx.max_required_samples) if ctx.max_required_samples > 0 else q

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> int | bool:
        k = self._lends_now(global_steps, ctx)
        return True if k > 0 and k >= max(1, ctx.hybrid_replicas) else k

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        """Only when the lent hybrids hold less than a standalone does: a rebalance aborts and
        re-prefills every in-flight request, which pays only where the headroom could not fill
        the hybrids. Before the load of a filled replica is measured (a clear win lends from the
        first step), the headroom tells: samples the staleness cap and the prompts still let start
        that the rollouter did not start mean every routable replica is at its concurrency, the
        lent ones too (``unstarted_headroom``)."""
        if ctx.in_flight_samples <= 0:
            return True
        if self.load["n"] == 0:
            return ctx.max_required_samples <= 0 or unstarted_headroom(ctx) <= 0
        replicas = max(1, ctx.standalone_replicas) + max(1, ctx.lent_replicas)
        return ctx.in_flight_samples < replicas * self.load["mean"] - 0.5

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        if self.only_hybrid or global_steps <= 0:
            return
        # what is lent now (the lend after this step's sync is done); a context that does not
        # count its hybrids (hybrid_replicas 0) is taken to have done what this policy answered
        lent = ctx.lent_replicas if ctx.hybrid_replicas > 0 else self._lends_now(global_steps, ctx)
        if lent:  # is the wait this lend pays for close to what the switches cost? a clear win?
            realized = self.realized_gain_s(global_steps)
            rho = self._lent_share(lent, ctx)
            bar = self.clear_gain * self.switch_s(lent)
            gain = self.clear_gain_s(lent, ctx, rho)
            self.clear = gain >= bar and (realized is None or realized >= bar)
            self.clear_margin = min(gain, math.inf if realized is None else realized) / bar if self.clear else 0.0
            self.marginal = not self.clear and (self.wait["mean"] < MARGINAL * self.switch_s(lent)
                                                or (realized is not None and realized < self.win_bar_s(lent)))
        self.free_waits = self.recent_waits(ctx)  # this cycle's wait, if it was a no-lend one
        if self.last_end_at is not None:
            self._observe(global_steps, ctx, ctx.now - self.last_end_at, self.last_lent, lent)
        if self.pause_left > 0:
            self.pause_left -= 1
        elif (lent and not self.clear and self.realized_gain_s(global_steps) is None
              and self.streak["lent"]["n"] >= MIN_LENT_CYCLES):
            self.pause_left, self.lends_since_refresh = PROBE_PAUSE, 0  # measure what it gave first
        elif lent:
            self.lends_since_refresh += 1
            if self.lends_since_refresh >= self.refresh_after(self.run_steps(global_steps, ctx)):
                self.pause_left, self.lends_since_refresh = PROBE_PAUSE, 0
        self.last_end_at, self.last_lent = float(ctx.now), int(lent)

    def _observe(self, step: int, ctx: DynamicScheduleContext, cycle_s: float, before: int, after: int) -> None:
        """Book one cycle's seconds under what was lent at its start and its end."""
        if after and ctx.last_activate_duration_s > 0:
            self.activate = _book(self.activate, after, ctx.last_activate_duration_s)
        if before and ctx.last_deactivate_duration_s > 0:
            self.deactivate = _book(self.deactivate, before, ctx.last_deactivate_duration_s)
        if before and after:
            if not self.streak["lent"]["n"] or self.streak["after"]["n"]:  # a new streak
                self.streak = _streak(sum(self.recent) / max(1, len(self.recent)))
                self.lend_ref = None
            self.streak = {**self.streak, "lent": _add(self.streak["lent"], cycle_s)}
            if self.streak["lent"]["n"] == LEND_REF:
                self.lend_ref = self.streak["lent"]["mean"]
        if before == 0 and after == 0 and step > START_UP_STEPS:
            self.base = _trend_add(self.base, step, cycle_s)
            self.wait = _add(self.wait, float(sum(ctx.step_wait_times)))
            if ctx.in_flight_samples > 0:
                self.load = _add(self.load, ctx.in_flight_samples / max(1, ctx.standalone_replicas))
            self.recent = (self.recent + [float(cycle_s)])[-AROUND:]
            self._close_streak(cycle_s)
        if before:  # the cycle began with a take-back: did the trainer still wait after it?
            ratio = self.model_ratio(ctx) if self.ratio is None else self.ratio
            waited = int(sum(ctx.step_wait_samples))
            cycle = max(1, ctx.step_required_samples)
            delta = min(RATIO_UP_MAX, max(RATIO_UP_MIN, RATIO_GAIN * waited / cycle)) if waited > 0 else -RATIO_DOWN
            self.ratio = round(min(1.0, max(0.0, ratio + delta)), 12)

    def _close_streak(self, cycle_s: float) -> None:
        """Fold a no-lend cycle into the streak's "after"; with ``AROUND`` of them, what the streak
        gave is measured (a streak of fewer than ``MIN_LENT_CYCLES`` measured cycles is dropped)."""
        lent = self.streak["lent"]
        if not lent["n"]:
            return
        if lent["n"] < MIN_LENT_CYCLES:
            self.streak = _streak()
            return
        after = _add(self.streak["after"], cycle_s)
        if after["n"] < AROUND:
            self.streak = {**self.streak, "after": after}
            return
        # A-B-A for a short streak; a long one's lend cycles are a running mean of its latest
        # ones, and the cycles before it drifted away: the cycles after it are the reference
        aba = self.streak["before"] > 0 and lent["n"] <= ABA_MAX
        around = (self.streak["before"] + after["mean"]) / 2 if aba else after["mean"]
        gain = min(self.wait["mean"], max(-self.switch_s(), around - lent["mean"]))
        # one A-B-A measurement is noisy (two cycles each side): what lending gave is the running
        # mean over the measured streaks, so one bad measurement after many good ones re-measures
        # sooner (trust starts over) rather than stopping a win that held for the whole run
        n = int((self.realized or {}).get("n", 0)) + 1
        mean = gain if n == 1 else self.realized["gain"] + _weight(n) * (gain - self.realized["gain"])
        # its standard error: a no-lend cycle's spread (the trend's residuals) over the cycles
        # compared, the measurements averaged counted as that many
        var = max(self.base["var"], 0.0)
        spread = var / _effective_n(lent["n"]) + (
            var / 4.0 * (1.0 / AROUND + 1.0 / after["n"]) if aba else var / after["n"])
        se = math.sqrt(spread / _effective_n(n))
        self.realized = {"gain": mean, "n": n, "base_n": self.base["n"], "se": se}
        self.confirmed = self.confirmed + 1 if self.clear and gain >= self.clear_gain * self.switch_s() else 0
        self.streak = _streak()

    # ------------------------------------------------------------------ reasons

    def explain(self, hook: str, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> str:
        if hook == "should_activate_after_step":
            if self.only_hybrid:
                return "only-hybrid: always re-activate"
            preds = self.predictions(global_steps + 1, ctx)
            shown = ", ".join(f"T[{k}] {t:.1f}±{se:.1f}s" for k, (t, se) in preds.items() if k)
            k = self._lends_now(global_steps, ctx)
            why = ("pause to re-measure T0" if self.pause_left else
                   "clear win" if k and self.clear_lend(global_steps, ctx) else
                   "probe the switch seconds" if k and not self.best_lend(global_steps + 1, ctx) else
                   "measuring T0" if min(self.base["n"], self.wait["n"]) < MIN_BASE_CYCLES else
                   "predicted win" if k else f"no win beyond {Z:g} se + {MARGIN:.0%} of T0")
            return (f"T0 {preds[0][0]:.1f}±{preds[0][1]:.1f}s, W {self.wait['mean']:.1f}s, C {self.switch_s():.1f}s, "
                    f"L {self.latency_s(ctx):.1f}s; "
                    f"{shown} → lend {k} ({why}); in flight {ctx.in_flight_samples} + queued {ctx.mq_size} "
                    f"of cap {ctx.max_required_samples}")
        if hook == "deactivate_wait_samples":
            ratio = self.model_ratio(ctx) if self.ratio is None else self.ratio
            src = "model" if self.ratio is None else "adapted"
            return f"queue {ratio:.2f} ({src}) of {ctx.step_required_samples} samples first"
        if hook == "update_after_step":
            return (f"T0 {self.base['level']:.1f}s (+{self.base['slope']:.2f}s/step) over {int(self.base['n'])} "
                    f"cycles, W {self.wait['mean']:.1f}s, switch {self.switch_s():.1f}s, "
                    f"lends since refresh {self.lends_since_refresh}")
        if hook == "request_rebalance":
            replicas = max(1, ctx.standalone_replicas) + max(1, ctx.lent_replicas)
            return (f"in flight {ctx.in_flight_samples} vs {replicas} replicas × {self.load['mean']:.1f} "
                    f"per filled replica over {int(self.load['n'])} cycles")
        if hook == "should_deactivate":
            return "hybrid active: take it back before training" if is_hybrid_active else "hybrid already off"
        return ""
