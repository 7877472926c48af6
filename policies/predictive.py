"""`predictive`: lend the trainer's GPUs only when a prediction of the next step says it wins.

Owns the step-time model of ``docs/policies.md``: from the cycles it has seen (``ctx.now`` at each
``update_after_step``), the trainer's waits, the replica counts, the staleness cap and the
measured switch seconds it predicts a cycle's time without lending (``T0``) and with k of the m
hybrids lent (``T[k]``); it lends only when a measured ``T[k]`` beats ``T0`` by more than the
uncertainty of the difference, and it measures a ``T[k]`` (a short probe) only when its prior says
that k wins. Must not: read the clock, do I/O, or change state anywhere but ``update_after_step``
(the questions are pure functions of the state and the context).
"""

from __future__ import annotations

import math

from policies.base import DynamicScheduleContext, DynamicSchedulePolicyBase
from policies.builtin import check_ratio
from policies.registry import register_policy

EMA_ALPHA = 0.3
"""Weight of a new cycle in the running means (after the first 1/alpha cycles, a plain mean)."""
MIN_BASE_CYCLES = 3
"""No-lend cycles to measure before any prediction is trusted."""
PROBE_LENDS = 2
"""Consecutive lends of one probe: cycles (0→k), (k→k), (k→0) are measured."""
FIRST_BACKOFF_STEPS = 24
"""Steps between a probe that lost and the next; doubles after each loss (at most MAX_BACKOFF)."""
MAX_BACKOFF_STEPS = 256
REFRESH_EVERY = 48
"""While lending, pause for two steps after this many lends, to re-measure the no-lend cycle."""
Z = 1.0
"""Standard errors a win must clear."""
NO_PROBE: dict[str, float] = {"k": 0, "left": 0, "lends": 0, "cycles": 0, "total": 0.0, "expected": 0.0}
EFFECT_TTL_STEPS = 48
"""A lend effect measured longer ago than this is forgotten (the prior stands in, so it is probed again)."""
TREND_BETA = 0.2
"""Share of a no-lend cycle's surprise that goes into the per-step slope."""
PRIOR_SWITCH_S = 6.0
"""Switch seconds per lend cycle (sync + activate + rebalance + deactivate) before one is measured."""


def _stat() -> dict[str, float]:
    return {"n": 0, "mean": 0.0, "var": 0.0}


def _add(stat: dict[str, float], x: float) -> dict[str, float]:
    """A new stat with ``x`` folded in: running mean and variance, exponential after 1/alpha."""
    n = stat["n"] + 1
    w = max(EMA_ALPHA, 1.0 / n)
    delta = x - stat["mean"]
    return {"n": n, "mean": stat["mean"] + w * delta, "var": (1.0 - w) * (stat["var"] + w * delta * delta)}


def _se(stat: dict[str, float]) -> float:
    """Standard error of a stat's mean (its effective sample size is capped by the EMA window)."""
    if stat["n"] <= 0:
        return math.inf
    return math.sqrt(max(stat["var"], 0.0) / min(stat["n"], 2.0 / EMA_ALPHA - 1.0))


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
    w = max(EMA_ALPHA, 1.0 / (trend["n"] + 1))
    return {
        "n": trend["n"] + 1,
        "level": _trend_at(trend, step) + w * err,
        "slope": trend["slope"] + TREND_BETA * w * err / gap,
        "step": step,
        "var": (1.0 - w) * (trend["var"] + w * err * err),
    }


@register_policy("predictive")
class PredictiveDynamicSchedulePolicy(DynamicSchedulePolicyBase):
    """Lends k of the m hybrids after a sync only when the predicted cycle time says it wins.

    ``deactivate_ratio`` is ignored but for only-hybrid runs (forced to 1.0, like the built-ins);
    the samples to wait for before taking the hybrids back come from the model.
    """

    def __init__(self, deactivate_ratio: float = 0.0, only_hybrid: bool = False):
        self.deactivate_ratio = 1.0 if only_hybrid else check_ratio(deactivate_ratio)
        self.only_hybrid = bool(only_hybrid)
        self.last_end_at: float | None = None
        """``ctx.now`` at the previous ``update_after_step`` (a cycle runs from one to the next)."""
        self.last_lent = 0
        """Hybrids lent at the end of the previous cycle."""
        self.base = _trend()
        """Seconds of a cycle that neither began nor ended with a lend, as a drifting trend (``T0``)."""
        self.wait = _stat()
        """Trainer wait seconds in those cycles."""
        self.effect: dict[str, dict[str, float]] = {}
        """Per k (a string, for JSON): measured seconds a lend of k adds to a cycle (``T[k] − T0``)."""
        self.switch = _stat()
        """Measured switch seconds per lending cycle (activate + deactivate of one cycle)."""
        self.probe: dict[str, float] = dict(NO_PROBE)
        """The running probe: k, lends still to do, lends done, measured and expected seconds."""
        self.lending = 0
        """k while a measured win keeps the hybrids lent; 0 otherwise."""
        self.lends_since_refresh = 0
        self.pause_left = 0
        """Steps still to skip lending while re-measuring ``T0``."""
        self.next_probe_step = MIN_BASE_CYCLES + 1
        self.backoff = FIRST_BACKOFF_STEPS

    # ------------------------------------------------------------------ the model

    def prior_gain_s(self, k: int, ctx: DynamicScheduleContext) -> float:
        """Trainer wait seconds k hybrids would remove per cycle, before any lend is measured.

        Deliberately optimistic: the wait shrinks by the hybrids' share of the replicas,
        k / (S + k), as if generation were throughput-bound. Where the staleness cap binds, the
        hybrids add no throughput (only thinner batches, so somewhat faster sequences): the probe
        measures what a lend really does, and a measured loss stops the lending.
        """
        if self.wait["n"] == 0 or k <= 0:
            return 0.0
        return self.wait["mean"] * k / (max(0, ctx.standalone_replicas) + k)

    def switch_s(self) -> float:
        return self.switch["mean"] if self.switch["n"] else PRIOR_SWITCH_S

    def predictions(self, step: int, ctx: DynamicScheduleContext) -> dict[int, tuple[float, float, str]]:
        """k → (predicted seconds of cycle ``step``, uncertainty, source) for k = 0 (no lend) … m.

        ``T0`` is the no-lend trend; a measured ``T[k]`` is ``T0`` plus the measured effect of
        lending k; an unmeasured one (or one measured more than ``EFFECT_TTL_STEPS`` ago: the run
        has moved on) is ``T0`` − the prior's gain + the switch seconds.
        """
        base, spread = _trend_at(self.base, step), math.sqrt(max(self.base["var"], 0.0))
        base_se = spread / math.sqrt(max(1.0, min(self.base["n"], 2.0 / EMA_ALPHA - 1.0)))
        out: dict[int, tuple[float, float, str]] = {0: (base, base_se, "measured")}
        for k in range(1, max(1, ctx.hybrid_replicas) + 1):
            effect = self.effect.get(str(k))
            if effect and effect["n"] > 0 and step - effect.get("step", step) <= EFFECT_TTL_STEPS:
                out[k] = (base + effect["mean"], math.sqrt(_se(effect) ** 2 + base_se ** 2), "measured")
            else:
                out[k] = (base - self.prior_gain_s(k, ctx) + self.switch_s(), spread, "prior")
        return out

    def prior_choice(self, step: int, ctx: DynamicScheduleContext) -> int:
        """The k whose unmeasured prior beats ``T0`` most (0: none; ties: the larger k, whose
        replicas share the in-flight samples more thinly): worth a probe."""
        preds = self.predictions(step, ctx)
        unmeasured = [k for k in range(1, len(preds)) if preds[k][2] == "prior"]
        if not unmeasured:
            return 0
        best = min(unmeasured, key=lambda k: (round(preds[k][0], 9), -k))
        # to beat: no lend, and every measured k by its uncertainty
        bar = min([preds[0][0]] + [t + se for t, se, src in preds.values() if src == "measured"][1:])
        return best if preds[best][0] < bar else 0

    def _lends_now(self, ctx: DynamicScheduleContext) -> int:
        if self.only_hybrid:
            return max(1, ctx.hybrid_replicas)
        if self.pause_left > 0:
            return 0
        if self.probe["left"] > 0:
            return int(self.probe["k"])
        return self.lending

    # ------------------------------------------------------------------ hooks

    def should_deactivate(self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> bool:
        return is_hybrid_active

    def deactivate_wait_samples(self, ctx: DynamicScheduleContext) -> int:
        """Queue the samples the trainer would have waited for: q = cycle × W / D, with W the
        trainer's wait in a no-lend cycle of D seconds (at least one micro-step's worth)."""
        cycle = ctx.step_required_samples
        if self.only_hybrid:
            return cycle
        d = self.base["level"]
        q = cycle * self.wait["mean"] / d if d > 0 else cycle / 2
        q = max(ctx.required_samples, min(cycle, int(round(q))))
        return min(q, ctx.max_required_samples) if ctx.max_required_samples > 0 else q

    def should_activate_after_step(
        self, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext
    ) -> int | bool:
        k = self._lends_now(ctx)
        return True if k > 0 and k >= max(1, ctx.hybrid_replicas) else k

    def request_rebalance(self, global_steps: int, ctx: DynamicScheduleContext) -> bool:
        return True

    def update_after_step(self, global_steps: int, ctx: DynamicScheduleContext) -> None:
        if self.only_hybrid or global_steps <= 0:
            return
        # what is lent now (the lend after this step's sync is done); a context that does not
        # count its hybrids (hybrid_replicas 0) is taken to have done what this policy answered
        lent = ctx.lent_replicas if ctx.hybrid_replicas > 0 else self._lends_now(ctx)
        if self.last_end_at is not None:
            self._observe(global_steps, ctx, ctx.now - self.last_end_at, self.last_lent, lent)
        self._advance(global_steps, lent, ctx)
        self.last_end_at, self.last_lent = float(ctx.now), int(lent)

    def _observe(self, step: int, ctx: DynamicScheduleContext, cycle_s: float, before: int, after: int) -> None:
        """Book one cycle's seconds under what was lent at its start and its end."""
        switched = ctx.last_activate_duration_s + ctx.last_deactivate_duration_s
        if before and switched > 0:
            self.switch = _add(self.switch, switched)
        if before == 0 and after == 0:
            self.base = _trend_add(self.base, step, cycle_s)
            self.wait = _add(self.wait, float(sum(ctx.step_wait_times)))
        elif self.probe["k"]:
            self.probe = {**self.probe, "total": self.probe["total"] + cycle_s,
                          "expected": self.probe["expected"] + _trend_at(self.base, step),
                          "cycles": self.probe["cycles"] + 1}
        elif before and before == after:
            key = str(before)
            self.effect[key] = {**_add(self.effect.get(key, _stat()), cycle_s - _trend_at(self.base, step)),
                                "step": step}

    def _advance(self, step: int, lent: int, ctx: DynamicScheduleContext) -> None:
        """Move the refresh pause, the probe or the lending run on by one step; maybe start a probe."""
        probe = self.probe
        if self.pause_left > 0:
            self.pause_left -= 1
        elif probe["k"]:
            if probe["left"] > 0 and lent:
                probe = {**probe, "left": probe["left"] - 1, "lends": probe["lends"] + 1}
            if probe["left"] <= 0 and not lent:  # the closing (k→0) cycle is in: judge the probe
                self._judge_probe(step, probe)
                probe = dict(NO_PROBE)
            self.probe = probe
        elif self.lending:
            self._keep_or_stop(step, ctx)
        idle = not self.probe["k"] and not self.lending and self.pause_left == 0
        if idle and step + 1 >= self.next_probe_step and self.base["n"] >= MIN_BASE_CYCLES:
            k = self.prior_choice(step + 1, ctx)
            if k:
                self.probe = {**NO_PROBE, "k": k, "left": PROBE_LENDS}
            else:
                self.next_probe_step = step + 1 + FIRST_BACKOFF_STEPS // 4

    def _judge_probe(self, step: int, probe: dict[str, float]) -> None:
        """effect per lend = (measured − expected no-lend seconds) / lends; a win clears Z errors."""
        lends, cycles = max(1, int(probe["lends"])), int(probe["cycles"])
        spread = math.sqrt(max(self.base["var"], 0.0))
        effect = (probe["total"] - probe["expected"]) / lends
        se = spread * math.sqrt(cycles + cycles * cycles / max(1, self.base["n"])) / lends
        n_eff = min(lends, 2.0 / EMA_ALPHA - 1.0)
        self.effect[str(int(probe["k"]))] = {"n": lends, "mean": effect, "var": se * se * n_eff, "step": step}
        if effect + Z * se < 0:
            self.lending, self.lends_since_refresh = int(probe["k"]), 0
            self.backoff = FIRST_BACKOFF_STEPS
        else:
            self._lost(step)

    def _keep_or_stop(self, step: int, ctx: DynamicScheduleContext) -> None:
        """Started on a win by more than the uncertainty; kept while the measured mean still wins."""
        preds = self.predictions(step + 1, ctx)
        if preds[self.lending][0] >= preds[0][0]:
            self.lending = 0
            self._lost(step)
            return
        self.lends_since_refresh += 1
        if self.lends_since_refresh >= REFRESH_EVERY:
            self.pause_left, self.lends_since_refresh = 2, 0

    def _lost(self, step: int) -> None:
        self.next_probe_step = step + 1 + self.backoff
        self.backoff = min(MAX_BACKOFF_STEPS, self.backoff * 2)

    # ------------------------------------------------------------------ reasons

    def explain(self, hook: str, global_steps: int, is_hybrid_active: bool, ctx: DynamicScheduleContext) -> str:
        if hook == "should_activate_after_step":
            if self.only_hybrid:
                return "only-hybrid: always re-activate"
            preds = self.predictions(global_steps + 1, ctx)
            shown = ", ".join(f"T[{k}] {t:.1f}±{se:.1f}s {src}" for k, (t, se, src) in preds.items() if k)
            k = self._lends_now(ctx)
            why = ("pause to re-measure T0" if self.pause_left else
                   f"probe, {int(self.probe['left'])} lends left" if self.probe["left"] > 0 else
                   "measured win" if self.lending else
                   "measuring T0" if self.base["n"] < MIN_BASE_CYCLES else "no measured win")
            return (f"T0 {preds[0][0]:.1f}±{preds[0][1]:.1f}s; {shown} → lend {k} ({why}); in flight "
                    f"{ctx.in_flight_samples} + queued {ctx.mq_size} of cap {ctx.max_required_samples}")
        if hook == "deactivate_wait_samples":
            return f"T0 {self.base['level']:.1f}s, wait {self.wait['mean']:.1f}s → queue first"
        if hook == "update_after_step":
            return (f"T0 {self.base['level']:.1f}s (+{self.base['slope']:.2f}s/step) over {int(self.base['n'])} "
                    f"cycles, switch {self.switch_s():.1f}s, lending {self.lending}, "
                    f"next probe at step {self.next_probe_step}")
        if hook == "should_deactivate":
            return "hybrid active: take it back before training" if is_hybrid_active else "hybrid already off"
        return ""
