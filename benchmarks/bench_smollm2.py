"""SmolLM2-135M-Instruct on GSM8K on CPU: a few real GRPO steps with validation, measured.

Two `tidal run smollm2-gsm8k` runs in a scratch dir (each with its own store, run dir and
`PREFECT_HOME`; ``benchmarks.train_curve.run_training``): gradient checkpointing off, validated on
``--val-samples`` GSM8K test questions (greedy) before step 1 and after the last step, then
gradient checkpointing on (validated too only with ``--validate-both``). Records per run: rollout
tokens/s (``fully_async/rollouter/step_generated_tokens`` over the steps' wall time), step time,
the peak RSS of the trainer actor (which also hosts the hybrid replica) and of the standalone engine
actors (``VmHWM`` of the run's Ray worker processes, read from ``/proc`` every second while the
run lives), the mean train reward and the validation accuracy before / after. The model and the
GSM8K parquet are built once into ``--files`` (``models.smollm2.ensure_smollm2``).

Usage:
    .venv/bin/python benchmarks/bench_smollm2.py [--engine torch|vllm] [--steps 3] [--val-samples 50]
        [--gc both|off|on] [--validate-both] [--set KEY=VALUE ...] [--files DIR] [--workdir DIR]
        [--timeout 1500] [--dtypes float32,bfloat16] [--json-out PATH]

``--json-out`` writes the figures to PATH (the lead merges them into ``benchmarks/results.json``).
Must not: reuse anyone's store or Prefect home, or stop processes it did not start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_curve import read_steps, run_training  # noqa: E402
from models.smollm2 import SMOLLM2_PRESET, SMOLLM2_ROOT, SmolLM2Error, ensure_smollm2  # noqa: E402

TOKENS = "fully_async/rollouter/step_generated_tokens"
VAL = "val-core/openai/gsm8k/reward/mean@1"
ROLES = {"ray::TrainerActor": "trainer", "ray::ReplicaActor": "engine"}
"""Process titles of Ray workers (``ray::<actor class>[.<method>]``) → what the figure calls them."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch", help="rollout engine (default torch)")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    p.add_argument("--val-samples", type=int, default=50, help="GSM8K test questions validated (default 50)")
    p.add_argument("--gc", choices=("both", "off", "on"), default="both",
                   help="gradient checkpointing: one run each (both, default) or only one")
    p.add_argument("--validate-both", action="store_true", help="validate in the checkpointing run too")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for both runs (repeatable)")
    p.add_argument("--files", default=str(ROOT / SMOLLM2_ROOT),
                   help=f"the model + data folder (default {SMOLLM2_ROOT})")
    p.add_argument("--workdir", default=None, help="scratch dir (default: a fresh temp dir)")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds one run may take (default 1500)")
    p.add_argument("--json-out", default=None, help="write the figures as JSON here")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="first, the torch engine alone on the model in each dtype: 8 requests × 32 tokens "
                        "(comma list; '' = skip)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.val_samples < 1:
        p.error("--steps and --val-samples must be at least 1")
    return args


# -------------------------------------------------------------------------------- peak RSS


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, command line) of every live process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        table[int(entry.name)] = (int(stat.rpartition(")")[2].split()[1]), cmd)
    return table


def _hwm_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakRSS:
    """Samples the peak RSS (``VmHWM``) of this process's descendants every ``period_s`` in a
    thread, keyed by role (``ROLES``; the ``tidal run`` driver itself is ``driver``)."""

    def __init__(self, period_s: float = 1.0):
        self.period_s = period_s
        self.peak_kb: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peak-rss", daemon=True)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            table = _proc_table()
            for pid, (ppid, cmd) in table.items():
                role = self._role(pid, ppid, cmd, table, me)
                hwm = _hwm_kb(pid) if role else None
                if hwm is not None:
                    self.peak_kb[pid] = (role, max(hwm, self.peak_kb.get(pid, (role, 0))[1]))
            self._stop.wait(self.period_s)

    @staticmethod
    def _role(pid: int, ppid: int, cmd: str, table: dict[int, tuple[int, str]], me: int) -> str | None:
        if ppid == me:
            return "driver" if " run " in f" {cmd} " else None
        for title, role in ROLES.items():
            if cmd.startswith(title):
                up = ppid
                while up > 1 and up in table:  # only the workers of the run this process started
                    if up == me:
                        return role
                    up = table[up][0]
        return None

    def by_role(self) -> dict[str, float]:
        """Largest peak RSS in MiB per role (the engine role: the largest standalone replica)."""
        out: dict[str, float] = {}
        for role, kb in self.peak_kb.values():
            out[role] = max(out.get(role, 0.0), kb / 1024)
        return out


# -------------------------------------------------------------------------------- engine dtype


def engine_dtype_speed(model_dir: Path, dtype: str, concurrency: int = 8, budget: int = 32) -> dict:
    """The torch engine alone on the converted model in ``dtype``: decode tokens/s with
    ``concurrency`` GSM8K-like chat prompts in flight, each generating ``budget`` tokens (EOS
    ignored), after a warm-up; plus the greedy tokens of one prompt (to compare the dtypes)."""
    import asyncio

    from benchmarks.bench_hf_engine import engine_run
    from cluster.engines.hf_runner import HFRunner
    from cluster.engines.torch_engine import TorchEngine
    from data.types import GenerationRequest, SamplingSpec
    from models.hf import load_model, load_tokenizer

    tok = load_tokenizer(model_dir)
    text = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May? Let's think step by step and output "
            'the final answer after "####".')
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    model = load_model(model_dir, dtype=dtype)
    engine = TorchEngine(HFRunner(model), max_batch=concurrency, threads=None, eos_id=tok.eos_token_id)

    async def go() -> tuple[float, list[int]]:
        await engine.load_weights(model.state_dict(), 1)
        await engine_run(engine, [(prompt, 8)] * concurrency, concurrency, "warm")
        wall = await engine_run(engine, [(prompt, budget)] * concurrency, concurrency, "timed")
        greedy = await engine.generate(GenerationRequest("greedy", prompt, SamplingSpec(32, temperature=0.0)))
        await engine.shutdown()
        return wall, list(greedy.tokens)

    wall, greedy = asyncio.run(go())
    return {"dtype": dtype, "concurrency": concurrency, "tokens": concurrency * budget,
            "tok_s": round(concurrency * budget / wall, 1), "greedy_32": tok.decode(greedy)}


# -------------------------------------------------------------------------------- one run


def one_run(args: argparse.Namespace, workdir: Path, gc: bool, validate: bool) -> dict:
    """`tidal run smollm2-gsm8k` in ``workdir`` with gradient checkpointing ``gc``; its figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / SMOLLM2_ROOT
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(Path(args.files).resolve())
    overrides = [f"engines.rollout={args.engine}", f"actor_rollout_ref.model.enable_gradient_checkpointing={gc}",
                 f"data.val_max_samples={args.val_samples}", f"trainer.test_freq={args.steps if validate else -1}",
                 f"trainer.val_before_train={validate}", *args.overrides]
    run_args = argparse.Namespace(config=SMOLLM2_PRESET, steps=args.steps, overrides=overrides, timeout=args.timeout)
    with PeakRSS() as rss:
        cmd, wall_s, code, log = run_training(run_args, workdir)
    from flows.lifecycle import end_leftovers

    for records in workdir.glob("**/driver"):  # a run stopped by --timeout leaves its Prefect server up
        end_leftovers(records.parent)
    result = {"gradient_checkpointing": gc, "command": cmd, "exit_code": code, "wall_s": round(wall_s, 1),
              "peak_rss_mib": {k: round(v) for k, v in sorted(rss.by_role().items())}, "log": str(log)}
    if code != 0:
        print(f"`tidal run` exited with {code} after {wall_s:.0f} s; last lines of {log}:", file=sys.stderr)
        print("\n".join(log.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
    try:  # a run stopped by --timeout still has its committed steps
        uid, rows = read_steps(workdir)
    except Exception as exc:  # no store, or no run in it
        print(f"no committed step to read: {exc}", file=sys.stderr)
        return result
    if rows:
        result.update(summarize(rows))
    result["run"] = uid
    return result


def _num(row: dict, key: str) -> float:
    value = row.get(key)
    return math.nan if value is None else float(value)


def summarize(rows: list[dict]) -> dict:
    """The run's figures from its committed steps."""
    walls = [_num(r, "wall_s") for r in rows]
    tokens = [_num(r, TOKENS) for r in rows]
    before = [_num(r, f"{VAL}/before_train") for r in rows if f"{VAL}/before_train" in r]
    after = [_num(r, VAL) for r in rows if VAL in r]
    return {
        "steps": len(rows),
        "step_s": [round(w, 1) for w in walls],
        "step_s_median": round(statistics.median(walls), 1),
        "rollout_tokens": int(sum(t for t in tokens if not math.isnan(t))),
        "rollout_tokens_per_s": round(sum(t for t in tokens if not math.isnan(t)) / sum(walls), 2),
        "response_length_mean": round(statistics.fmean(_num(r, "response_length/mean") for r in rows), 1),
        "train_score_mean": [round(_num(r, "critic/score/mean"), 3) for r in rows],
        "val_accuracy_before": before[0] if before else None,
        "val_accuracy_after": after[-1] if after else None,
    }


def print_run(name: str, r: dict) -> None:
    rss = r["peak_rss_mib"]
    print(f"{name}: exit {r['exit_code']}, {r['wall_s']:.0f} s wall; peak RSS trainer {rss.get('trainer', '-')} MiB, "
          f"engine {rss.get('engine', '-')} MiB, driver {rss.get('driver', '-')} MiB")
    if "steps" in r:
        print(f"  {r['steps']} committed steps {r['step_s']} s (median {r['step_s_median']}); "
              f"rollout {r['rollout_tokens']} tokens, {r['rollout_tokens_per_s']} tok/s; "
              f"mean response {r['response_length_mean']} tokens; train score {r['train_score_mean']}; "
              f"validation {r['val_accuracy_before']} -> {r['val_accuracy_after']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        built = ensure_smollm2(args.files)
    except SmolLM2Error as exc:
        print(f"bench_smollm2: {exc}", file=sys.stderr)
        return 2
    if built:
        print(f"built {', '.join(built)} in {args.files}")
    dtypes = []
    for dtype in filter(None, args.dtypes.split(",")):
        dtypes.append(engine_dtype_speed(Path(args.files) / "model", dtype))
        print(f"engine alone, {dtype}: {dtypes[-1]['tok_s']} tok/s at {dtypes[-1]['concurrency']} in flight; "
              f"greedy: {dtypes[-1]['greedy_32']!r}", flush=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tidal-smollm2-")).resolve()
    plan = {"both": [False, True], "off": [False], "on": [True]}[args.gc]
    runs = {}
    for gc in plan:
        name = "gc_on" if gc else "gc_off"
        runs[name] = one_run(args, workdir / name, gc, validate=not gc or args.validate_both or len(plan) == 1)
        print_run(name, runs[name])
        sys.stdout.flush()
    out = {"engine": args.engine, "steps": args.steps, "val_samples": args.val_samples, "runs": runs,
           "engine_dtypes": dtypes,
           "machine": f"{os.cpu_count()}-core {platform.machine()}", "load_average": list(os.getloadavg()),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": " ".join(["benchmarks/bench_smollm2.py", *(argv if argv is not None else sys.argv[1:])])}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {args.json_out}")
    return 0 if all(r["exit_code"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
