"""The `tidal` command line: parse → build → run → clean up; every bad input exits 2 in one line.

    tidal config show PRESET|FILE [--set key=value ...]
    tidal config check FILE [--set key=value ...]
    tidal config presets
    tidal simulate CONFIG [--set ...] [--policy NAME] [--steps N] [--seed S] [--json PATH]
                          [--plot DIR] [--compare]
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
import yaml

try:  # typer >= 0.20 vendors its own click; its exceptions are not click's
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exc

from config import ConfigError, TidalConfig, list_presets, load_config, to_plain
from policies import UnknownPolicyError, resolve_policy_class
from storage.engine import StoreError

EXIT_BAD_INPUT = 2

app = typer.Typer(
    name="tidal",
    help="Tidal: lend trainer GPUs to rollout while fully-async RL training waits for samples.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Show, check and list configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a key: --set async_training.staleness_threshold=1.0 (repeatable)."),
]


class BadInput(Exception):
    """Anything the user can fix: printed as one line, exit 2."""


def load_checked(config: str, overrides: list[str] | None) -> TidalConfig:
    """Load a config and check what the schema alone cannot (the policy name resolves)."""
    cfg = load_config(config, overrides or [])
    name = cfg.async_training.dynamic_schedule_policy
    try:
        resolve_policy_class(name)
    except UnknownPolicyError as exc:
        raise ConfigError(f"async_training.dynamic_schedule_policy: {exc}") from None
    return cfg


def describe(cfg: TidalConfig) -> str:
    """One line saying what the config will run."""
    a = cfg.async_training
    mode = "only-hybrid" if cfg.only_hybrid else ("dynamic" if a.use_dynamic_resource_scheduling else "static")
    return (
        f"{mode}: {cfg.trainer_gpus} trainer GPU(s) ({cfg.hybrid_replicas} hybrid replica(s)) + "
        f"{cfg.standalone_gpus} rollout GPU(s) ({cfg.standalone_replicas} standalone replica(s)); "
        f"policy {a.dynamic_schedule_policy}; {cfg.step_required_samples} samples/step; "
        f"queue capacity {cfg.max_required_samples}"
    )


@config_app.command("show")
def config_show(
    config: Annotated[str, typer.Argument(help="Preset name (see `tidal config presets`) or YAML file.")],
    set_: SetOption = None,
) -> None:
    """Print the resolved config (every key, defaults included) as YAML."""
    cfg = load_checked(config, set_)
    typer.echo(f"# {describe(cfg)}")
    typer.echo(yaml.safe_dump(to_plain(cfg), sort_keys=False), nl=False)


@config_app.command("check")
def config_check(
    config: Annotated[str, typer.Argument(help="YAML file or preset name.")],
    set_: SetOption = None,
) -> None:
    """Validate a config; exit 0 and one summary line when it is good, exit 2 when not."""
    cfg = load_checked(config, set_)
    typer.echo(f"ok: {config}: {describe(cfg)}")


@config_app.command("presets")
def config_presets() -> None:
    """List the shipped presets."""
    for name in list_presets():
        typer.echo(name)


@config_app.command("reference")
def config_reference() -> None:
    """Print the config reference (every key, default, limits, meaning) as a markdown table."""
    from config.reference import markdown_reference

    typer.echo(markdown_reference(), nl=False)


@app.command("simulate")
def simulate(
    config: Annotated[str, typer.Argument(help="Preset name or YAML file.")],
    set_: SetOption = None,
    policy: Annotated[str | None, typer.Option(help="Override the policy name.")] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="Stop after this many steps.")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Simulator seed.")] = 0,
    json_path: Annotated[str | None, typer.Option("--json", help="Write the result as JSON here.")] = None,
    plot: Annotated[str | None, typer.Option(help="Write PNG plots into this folder.")] = None,
    compare: Annotated[bool, typer.Option(help="Also run every static split and the dynamic setups.")] = False,
) -> None:
    """Run the discrete-event twin of the whole loop with the real policies (no GPUs needed)."""
    from flows.simulate import simulate_main

    overrides = list(set_ or [])
    if policy is not None:
        overrides.append(f"async_training.dynamic_schedule_policy={policy}")
    load_checked(config, overrides)
    code = simulate_main(
        config=config,
        overrides=overrides,
        policy=policy,
        steps=steps,
        seed=seed,
        json_path=json_path,
        plot_dir=plot,
        compare=compare,
    )
    raise typer.Exit(code)


@app.command("run")
def run(
    config: Annotated[str, typer.Argument(help="Preset name or YAML file.")],
    set_: SetOption = None,
) -> None:
    """Train: one Prefect flow run per step over the Ray data plane; the store keeps every step."""
    cfg = load_checked(config, set_)
    from flows.training_run import training_run
    from tasks.commit import engine_for

    # A malformed or unreachable store fails here, in one line, before any flow run starts.
    engine_for(cfg.storage.url, cfg.storage.busy_timeout_ms)
    from flows.runners import prefect_settings_for

    with prefect_settings_for(cfg):
        result = training_run(config=config, overrides=list(set_ or []))
    typer.echo(f"run {result['run']} finished: {result['output_dir']}")


@app.command("resume")
def resume(
    run_id: Annotated[str, typer.Argument(help="Run id (see `tidal runs`).")],
    storage: Annotated[str | None, typer.Option(help="Store URL (default: the preset's).")] = None,
) -> None:
    """Continue a run from its last committed step, with its own resolved config."""
    from flows.training_run import training_run

    from flows.runners import prefect_settings_for

    config_path = _run_config_path(run_id, storage)
    with prefect_settings_for(load_checked(str(config_path), [])):
        result = training_run(config=str(config_path), overrides=[], resume=run_id)
    typer.echo(f"run {result['run']} finished: {result['output_dir']}")


@app.command("runs")
def runs(storage: Annotated[str | None, typer.Option(help="Store URL.")] = None) -> None:
    """List the runs in the store."""
    from storage import run_summaries, session_scope

    with session_scope(_open_store(storage)) as session:
        rows = run_summaries(session)
    if not rows:
        typer.echo("no runs")
    for r in rows:
        typer.echo(f"{r.uid}  {r.status:<8}  policy {r.policy:<18}  steps {r.steps:>4}  wall {r.wall_s:8.1f}s")


@app.command("report")
def report(
    run_id: Annotated[str, typer.Argument(help="Run id.")],
    storage: Annotated[str | None, typer.Option(help="Store URL.")] = None,
) -> None:
    """Write the run's markdown report and plots again and print the markdown."""
    from pathlib import Path

    from flows.report import write_report

    cfg = load_checked(str(_run_config_path(run_id, storage)), [])
    out = write_report(cfg, run_id, Path(cfg.trainer.default_local_dir) / run_id)
    typer.echo(Path(out["markdown"]).read_text(encoding="utf-8"), nl=False)


def _store_url(storage: str | None) -> str:
    return storage or load_config("tiny-cpu").storage.url


def _open_store(storage: str | None):
    """An engine on an existing store; a SQLite file that is not there is bad input (reading
    commands never create a store), a malformed or unreachable URL is a StoreError."""
    from storage import make_engine
    from storage.engine import _parse_url, _sqlite_file

    url = _parse_url(_store_url(storage))
    path = _sqlite_file(url) if url.get_backend_name() == "sqlite" else None
    if path is not None and not path.is_file():
        raise BadInput(f"no store at {path} (check --storage or storage.url)")
    return make_engine(url)


def _run_config_path(run_id: str, storage: str | None):
    from pathlib import Path

    from config.loader import RESOLVED_FILENAME
    from storage import get_run, session_scope

    engine = _open_store(storage)
    with session_scope(engine) as session:
        row = get_run(session, run_id)
        if row is None:
            raise BadInput(f"run {run_id!r}: no such run in {engine.url.render_as_string(hide_password=True)}")
        path = Path(row.output_dir) / RESOLVED_FILENAME
    if not path.is_file():
        raise BadInput(f"run {run_id!r}: its resolved config {path} is missing")
    return path


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the app, turning every bad input into one line and exit 2."""
    # Prefect's telemetry heartbeat races the first flow run on a temporary server's SQLite
    # ("database is locked" tracebacks); it sends nothing from here anyway.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        code = app(args=argv, prog_name="tidal", standalone_mode=False)
    except (ConfigError, UnknownPolicyError, BadInput, StoreError) as exc:
        print(f"tidal: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except click_exc.NoArgsIsHelpError:
        return 0
    except click_exc.UsageError as exc:
        print(f"tidal: error: {_one_line(exc.format_message())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except typer.Exit as exc:  # typer >= 0.20: not in its click's exceptions module
        return exc.exit_code
    except typer.Abort:
        print("tidal: aborted", file=sys.stderr)
        return 130
    except click_exc.ClickException as exc:
        print(f"tidal: error: {_one_line(exc.format_message())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return code if isinstance(code, int) else 0  # a command's `raise typer.Exit(n)` comes back as n


if __name__ == "__main__":
    sys.exit(main())
