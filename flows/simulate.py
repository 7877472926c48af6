"""`tidal simulate`: run the discrete-event twin on a config, print, save JSON and plots.

Parse → build → run → report. With ``compare`` it also runs every static split of the same GPUs
(in replica-size steps) and the dynamic setups on the config's own split, prints them side by side
with each one's fluid bound and its lower bound that counts the staleness rule (``sim.bound``), and
names the best static split. Bad input raises
``config.ConfigError`` with a one-line message (the CLI maps it to exit code 2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from config import ConfigError, TidalConfig, load_config
from policies import UnknownPolicyError, resolve_policy_class
from sim import SimResult, SimulationStalled, simulate, spec_from_config, static_splits, with_policy
from sim.bound import Bound, lower_bound

DYNAMIC_POLICIES = ("default", "fixed_ratio", "predictive")
"""Policies a ``--compare`` runs on the config's own split when ``--policy`` is not given."""


@dataclass
class Setup:
    """One compared configuration and its simulated run."""

    label: str
    cfg: TidalConfig
    result: SimResult | None = None
    bound: Bound | None = None
    """The run's lower bounds (``sim.bound``): work, and the staleness rule's waits."""


def describe(cfg: TidalConfig) -> str:
    """``dynamic 16+16 default`` / ``static 8+24``: kind, trainer + standalone GPUs, policy."""
    split = f"{cfg.trainer_gpus}+{cfg.standalone_gpus}"
    if cfg.hybrid_replicas:
        return f"dynamic {split} {cfg.async_training.dynamic_schedule_policy}"
    return f"static {split}"


def build_setups(cfg: TidalConfig, policy: str | None) -> list[Setup]:
    """The static splits, then the dynamic policies on ``cfg``'s own split."""
    setups = [Setup(label, c) for label, c in static_splits(cfg)]
    if cfg.trainer_gpus % cfg.gpus_per_replica == 0:
        for name in (policy,) if policy else DYNAMIC_POLICIES:
            dyn = with_policy(cfg, name, dynamic=True)
            setups.append(Setup(describe(dyn), dyn))
    return setups


def _run(setup: Setup, steps: int | None, seed: int) -> Setup:
    """Simulate ``setup.cfg`` and bound it; returns the setup, filled in."""
    try:
        setup.result = simulate(setup.cfg, seed=seed, steps=steps)
    except SimulationStalled as exc:
        raise ConfigError(f"simulation stalled: {exc}") from None
    setup.bound = lower_bound(spec_from_config(setup.cfg, steps), setup.result)
    return setup


TIME_COLUMNS = ("setup", "wall h", "fluid h", "× fluid", "bound h", "× bound", "binds", "samples/s")
USE_COLUMNS = ("setup", "train U", "rollout\nU", "cluster\nU", "switches", "aborted\ntok", "re-prefill\ntok",
               "switch s")
WIDTH = 100
"""Columns the printed tables fit in (a narrower terminal wraps cells, never truncates numbers)."""


def _new_table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False,
                  title_justify="left")
    for name in columns:
        table.add_column(name, justify="left" if name == "setup" else "right", overflow="fold")
    return table


def tokens(n: int) -> str:
    """``812``, ``48.2 k``, ``4.48 M``, ``1.20 G``: a count in at most 7 columns."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def _tables(setups: list[Setup], title: str) -> list[Table]:
    """Two tables of at most ``WIDTH`` columns: time and bounds, then utilization and waste."""
    times = _new_table(f"{title}: time", TIME_COLUMNS)
    use = _new_table(f"{title}: utilization and wasted work", USE_COLUMNS)
    for s in setups:
        r, b = s.result, s.bound
        assert r is not None and b is not None
        times.add_row(
            s.label,
            f"{r.wall_clock_s / 3600:.3f}",
            f"{r.fluid_bound_s / 3600:.3f}",
            f"{r.wall_clock_s / r.fluid_bound_s:.2f}" if r.fluid_bound_s > 0 else "-",
            f"{b.lower_bound_s / 3600:.3f}",
            f"{r.wall_clock_s / b.lower_bound_s:.2f}" if b.lower_bound_s > 0 else "-",
            b.binding,
            f"{r.samples_per_s:.3f}",
        )
        use.add_row(
            s.label,
            f"{r.mean('train_util'):.3f}",
            f"{r.mean('rollout_util'):.3f}",
            f"{r.mean('cluster_util'):.3f}",
            str(r.switches),
            tokens(r.waste.aborted_tokens),
            tokens(r.waste.reprefilled_tokens),
            f"{r.waste.switch_s:.0f}",
        )
    return [times, use]


def verdict(setups: list[Setup]) -> str:
    """One line: the fastest dynamic setup against the fastest static split, by how much."""
    statics = [s for s in setups if not s.cfg.hybrid_replicas]
    dynamics = [s for s in setups if s.cfg.hybrid_replicas]
    static = min(statics, key=lambda s: s.result.wall_clock_s)  # type: ignore[union-attr]
    st = static.result.wall_clock_s  # type: ignore[union-attr]
    split = f"{static.cfg.trainer_gpus} trainer + {static.cfg.standalone_gpus} rollout GPUs"
    if not dynamics:
        return f"best static split: {static.label} ({split}, {st / 3600:.3f} h); no dynamic setup to compare"
    dynamic = min(dynamics, key=lambda s: s.result.wall_clock_s)  # type: ignore[union-attr]
    dyn = dynamic.result.wall_clock_s  # type: ignore[union-attr]
    pct = 100.0 * (dyn - st) / st if st > 0 else 0.0
    how = "as fast as" if abs(pct) < 0.05 else f"{abs(pct):.1f} % {'slower' if pct > 0 else 'faster'} than"
    name = dynamic.label.removeprefix("dynamic ")
    return (f"best dynamic {name} ({dyn / 3600:.3f} h) is {how} the best static "
            f"{static.cfg.trainer_gpus}+{static.cfg.standalone_gpus} ({st / 3600:.3f} h)")


def _summary(setup: Setup) -> dict:
    assert setup.result is not None and setup.bound is not None
    b, wall = setup.bound, setup.result.wall_clock_s
    return {
        "setup": setup.label,
        **setup.result.to_json(),
        "lower_bound_s": b.lower_bound_s,
        "ratio_to_lower_bound": wall / b.lower_bound_s if b.lower_bound_s > 0 else None,
        "lower_bound_binding": b.binding,
        "bounds_s": {"fluid": b.fluid_s, "rollout": b.rollout_s, "staleness": b.chain_s},
    }


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at every position (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def write_plots(setups: list[Setup], plot_dir: str | os.PathLike[str], window: int | None = None) -> list[Path]:
    """PNGs of mq_size, the three utilizations and step time over steps; one line per setup.

    Lines are rolling means over ``window`` steps (default: 1/50 of the run, at least 1).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    titles = {"mq_size.png": "queue size", "utilization.png": "resource utilization", "step_time.png": "step time"}
    panels = {
        "mq_size.png": [("mq_size", "mq_size (samples)")],
        "utilization.png": [
            ("train_util", "train utilization"),
            ("rollout_util", "rollout utilization"),
            ("cluster_util", "cluster utilization"),
        ],
        "step_time.png": [("step_time_s", "step time (s)")],
    }
    steps = max(len(s.result.steps) for s in setups if s.result is not None)
    window = window or max(1, steps // 50)
    note = f" (mean of {window} steps)" if window > 1 else ""
    written = []
    for filename, rows in panels.items():
        fig, axes = plt.subplots(len(rows), 1, figsize=(11, 3.2 * len(rows)), sharex=True, squeeze=False)
        fig.suptitle(f"{titles[filename]} by setup{note}", fontsize=10)
        for ax, (attr, ylabel) in zip(axes[:, 0], rows):
            for i, s in enumerate(setups):
                assert s.result is not None
                values = rolling_mean([float(getattr(st, attr)) for st in s.result.steps], window)
                ax.plot([st.step for st in s.result.steps], values, label=s.label, linewidth=1.2,
                        linestyle=("-", "--", "-.", ":")[i // 10 % 4])
            ax.set_title(ylabel, fontsize=9)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        # right of the plots: the legend covers no line
        axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.tight_layout(rect=(0, 0, 1, 0.96))
        path = out / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def simulate_main(
    config: str,
    overrides: list[str],
    policy: str | None,
    steps: int | None,
    seed: int,
    json_path: str | None,
    plot_dir: str | None,
    compare: bool,
) -> int:
    """Simulate ``config`` (and, with ``compare``, its alternatives); print, save, plot. Returns 0."""
    if seed < 0:
        raise ConfigError(f"--seed: must be >= 0 (got {seed})")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps: must be >= 1 (got {steps})")
    cfg = load_config(config, overrides)
    if policy is not None:
        try:
            resolve_policy_class(policy)
        except UnknownPolicyError as exc:
            raise ConfigError(f"--policy: {exc}") from None
        cfg = with_policy(cfg, policy)

    main = _run(Setup(describe(cfg), cfg), steps, seed)
    shown = [main]
    best_static: Setup | None = None
    if compare:
        others = build_setups(cfg, policy)
        if not any(s.label.startswith("static") for s in others):
            raise ConfigError("--compare: the config has too few GPUs for two rollout replicas' worth of splits")
        for s in others:
            if s.cfg == cfg:
                s.result, s.bound = main.result, main.bound
            else:
                _run(s, steps, seed)
        shown = others if any(s.cfg == cfg for s in others) else [main, *others]
        statics = [s for s in others if s.label.startswith("static")]
        best_static = min(statics, key=lambda s: s.result.wall_clock_s)  # type: ignore[union-attr]

    console = Console()
    if not console.is_terminal or console.width > WIDTH:  # files and pipes: 100 columns, as on a wide terminal
        console = Console(width=WIDTH, force_terminal=console.is_terminal)
    if policy is not None and not cfg.hybrid_replicas:
        console.print(
            f"note: dynamic scheduling is off in {config} (no hybrid replicas), so --policy {policy} "
            "is never asked; add --set async_training.use_dynamic_resource_scheduling=true"
        )
    n_steps = len(main.result.steps)  # type: ignore[union-attr]
    for table in _tables(shown, f"tidal simulate {config}, {n_steps} steps, seed {seed}"):
        console.print(table)
        console.print()
    console.print(main.result.weight_sync_line(), soft_wrap=True)  # type: ignore[union-attr]
    if compare:
        console.print(verdict(shown), soft_wrap=True)  # one line, whatever the width

    if json_path:
        data = _summary(main)
        if compare:
            data["compare"] = [_summary(s) for s in shown]
            data["best_static"] = best_static.label if best_static else None
            data["verdict"] = verdict(shown)
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if plot_dir:
        write_plots(shown, plot_dir)
    return 0
