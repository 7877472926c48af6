"""The fault campaign's figures: run the fault tests, count what was injected and what survived.

Owns: running ``pytest tests/faults`` with a fault report, and the ``fault_campaign`` section and
``results/faults.json``; with ``--preset tiny-hf``, the replica-kill, driver-SIGKILL and store-fault
files on that preset (``TIDAL_FAULT_PRESET``, ``tests/faults/fault_preset.py``), the
``fault_campaign_hf`` section and ``results/faults_hf.json``; with ``--platform``, the faults of the
platform around the run (issue 47: the store's PostgreSQL restarted, four runs on one store and one
Prefect server), the ``fault_campaign_platform`` section, ``results/faults_platform.json`` and
``faults.platform`` in ``results.json``. Must not: count a failed test as survived. How faults
are counted and the exit status: ``docs/benchmarks.md``; the faults: ``docs/fault-campaign.md``.

With ``--rerun FILE.py ...`` only those test files run again (on the same preset, ranks and
transport as the recorded campaign, which must exist): their cases and records replace the old
ones in the recorded figures, the totals are counted again, and ``reruns`` says which files ran
again at which commit (a campaign of 45 minutes whose one test failed on a test's own bug need not
run whole again).

Usage:
    .venv/bin/python benchmarks/fault_campaign.py [--preset tiny-cpu|tiny-hf] [--platform] [--no-write]
        [--ranks N] [--transport collective|object_store] [--rerun FILE.py ...]
        [--write RESULTS.md] [--json-out FILE.json] [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from results_io import RESULTS_DIR, RESULTS_MD, write_json, write_section  # noqa: E402

# files whose every test case injects one fault and records nothing itself: kind per file
PER_CASE = {"test_fault_bad_input.py": "invalid_input", "test_fault_store.py": "store_fault",
            "test_fault_store_restart.py": "store_restart", "test_security.py": "security_check"}


# what each preset runs, and where its figures go: (test paths, section of RESULTS.md, results/NAME.json)
CAMPAIGNS = {
    "tiny-cpu": (["tests/faults"], "fault_campaign", "faults"),
    "tiny-hf": (["tests/faults/test_fault_replica_kill.py", "tests/faults/test_fault_driver_kill.py",
                 "tests/faults/test_fault_store.py", "tests/faults/test_fault_postgres_run.py"],
                "fault_campaign_hf", "faults_hf"),
}
PLATFORM = (["tests/faults/test_fault_store_restart.py", "tests/faults/test_fault_postgres_restart_run.py",
             "tests/faults/test_platform_four_runs.py", "tests/faults/test_fault_ray_node.py",
             "tests/faults/test_fault_prefect_server.py", "tests/faults/test_fault_resume_sync_group.py"],
            "fault_campaign_platform", "faults_platform")
"""``--platform``: the platform's own faults, on the preset ``--preset`` names (one section, whichever)."""


def run_pytest(preset: str, report: Path, junit: Path, extra: list[str],
               paths: list[str] | None = None, plane: dict[str, str] | None = None) -> tuple[list[str], int, float]:
    paths = paths or CAMPAIGNS[preset][0]
    cmd = [sys.executable, "-m", "pytest", "-q", *paths, f"--junitxml={junit}", "-p", "no:cacheprovider", *extra]
    env = dict(os.environ, TIDAL_FAULT_REPORT=str(report), TIDAL_FAULT_PRESET=preset, **(plane or {}))
    t0 = time.perf_counter()
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    return cmd, code, time.perf_counter() - t0


def read_junit(junit: Path) -> list[dict]:
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        file = (case.get("file") or case.get("classname", "").replace(".", "/") + ".py").split("/")[-1]
        cases.append({"file": file, "name": case.get("name"), "outcome": outcome, "time_s": float(case.get("time", 0))})
    return cases


def tally(records: list[dict], cases: list[dict]) -> dict:
    kinds: dict[str, dict] = defaultdict(lambda: {"injected": 0, "survived": 0, "samples_lost": 0,
                                                   "samples_duplicated": 0, "tests": 0})
    for r in records:
        k = kinds[r["kind"]]
        for key in ("injected", "survived", "samples_lost", "samples_duplicated"):
            k[key] += int(r[key])
        k["tests"] += 1
    recorded_tests = {r["test"].split("::")[-1] for r in records}
    failed = []
    for c in cases:
        if c["outcome"] == "failed":
            failed.append(f"{c['file']}::{c['name']}")
        kind = PER_CASE.get(c["file"])
        if kind is None:
            if c["outcome"] == "failed" and c["name"] not in recorded_tests:
                kinds[f"failed:{c['file']}"]["injected"] += 1
                kinds[f"failed:{c['file']}"]["tests"] += 1
            continue
        if c["outcome"] == "skipped":
            continue
        k = kinds[kind]
        k["injected"] += 1
        k["survived"] += c["outcome"] == "passed"
        k["tests"] += 1
    total = {key: sum(k[key] for name, k in kinds.items() if name != "security_check")
             for key in ("injected", "survived", "samples_lost", "samples_duplicated")}
    return {**total, "kinds": dict(kinds), "failed_tests": failed,
            "tests": {"passed": sum(c["outcome"] == "passed" for c in cases),
                      "failed": sum(c["outcome"] == "failed" for c in cases),
                      "skipped": sum(c["outcome"] == "skipped" for c in cases)}}


def plane_words(ranks: int | None, transport: str | None) -> str:
    rank_words = f"{ranks} rank{'s' if ranks != 1 else ''}" if ranks else "the preset's one rank"
    return f"{rank_words}, weights to the standalones by {transport or 'the collective (the preset default)'}"


def markdown(command: str, t: dict, records: list[dict], took: float, preset: str = "tiny-cpu",
             platform: bool = False, ranks: int | None = None, transport: str | None = None) -> str:
    paths = " ".join(p.removeprefix("tests/faults/") for p in (PLATFORM if platform else CAMPAIGNS[preset])[0])
    title = "## Fault campaign (`fault_campaign.py`)" if preset == "tiny-cpu" else (
        f"## Fault campaign on {preset} (`fault_campaign.py --preset {preset}`)")
    if platform:
        title = "## Faults of the platform (`fault_campaign.py --platform`)"
    lines = [
        title,
        "",
        f"Command: `{command}`",
        "",
        f"`pytest {paths}` (`TIDAL_FAULT_PRESET={preset}`) with every fault test recording what it injected and found; "
        f"the trainer as {plane_words(ranks, transport)} (a test that sets its own keeps them); "
        f"{t['tests']['passed']} passed, {t['tests']['failed']} failed, {t['tests']['skipped']} skipped in {took:.0f} s. "
        f"**{t['injected']} faults injected, {t['survived']} survived, {t['samples_lost']} samples lost, "
        f"{t['samples_duplicated']} duplicated.** (Security checks are listed but not counted as faults.)",
        "",
        "| kind | tests | injected | survived | samples lost | samples duplicated |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, k in sorted(t["kinds"].items()):
        lines.append(f"| {kind} | {k['tests']} | {k['injected']} | {k['survived']} | {k['samples_lost']} | "
                     f"{k['samples_duplicated']} |")
    details = [r for r in records if r.get("details")]
    if details:
        lines += ["", "Details recorded by the tests:", ""]
        for r in details:
            d = ", ".join(f"{k}={v}" for k, v in r["details"].items())
            lines.append(f"- `{r['test']}` ({r['kind']}): {d}")
    if t["failed_tests"]:
        lines += ["", "Failed: " + ", ".join(f"`{f}`" for f in t["failed_tests"])]
    return "\n".join(lines) + "\n"


def rerun_paths(recorded: Path, files: list[str], ranks: int | None, transport: str | None) -> tuple[dict, list[str]]:
    """The recorded campaign ``--rerun`` amends, and the test paths it runs again; a usage error
    (``ValueError``: exit 2) when there is none or the compute plane asked for differs from the recorded one."""
    if not recorded.exists():
        raise ValueError(f"--rerun amends a recorded campaign; {recorded} does not exist")
    before = json.loads(recorded.read_text())
    want = {"trainer_ranks": ranks or 1, "transport": transport or "collective"}
    got = {k: before.get(k, 1 if k == "trainer_ranks" else "collective") for k in want}
    if want != got:
        raise ValueError(f"--rerun on {want}, but {recorded.name} was recorded on {got}")
    paths = []
    for f in files:
        path = f if f.startswith("tests/") else f"tests/faults/{f}"
        if not (ROOT / path).is_file():
            raise ValueError(f"--rerun {f}: no such test file {path}")
        paths.append(path)
    return before, paths


def merged(before: dict, paths: list[str], records: list[dict], cases: list[dict], took: float,
           code: int) -> tuple[list[dict], list[dict], float, int, list[dict]]:
    """The recorded campaign with the cases and records of ``paths`` replaced by the rerun's."""
    files = {Path(p).name for p in paths}
    kept_cases = [c for c in before.get("cases", []) if c["file"] not in files]
    kept_records = [r for r in before.get("records", []) if Path(r["test"].split("::")[0]).name not in files]
    failed_elsewhere = any(c["outcome"] == "failed" for c in kept_cases)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    reruns = [*before.get("reruns", []), {"files": sorted(files), "commit": commit, "seconds": round(took, 1),
                                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "campaign_commit": before.get("commit")}]
    return (kept_records + records, kept_cases + cases, before.get("seconds", 0.0) + took,
            code or int(failed_elsewhere), reruns)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(CAMPAIGNS), default="tiny-cpu",
                    help="tiny-cpu: every fault test; tiny-hf: replica kills, driver SIGKILLs, store faults")
    ap.add_argument("--platform", action="store_true",
                    help="only the platform's faults: PostgreSQL restarted mid-run, four runs on one store and server")
    ap.add_argument("--ranks", type=int, default=None, metavar="N",
                    help="the trainer's rank count in every run a fault test builds from the preset (TIDAL_FAULT_TRAINER_RANKS)")
    ap.add_argument("--transport", choices=("collective", "object_store"), default=None,
                    help="the standalones' weight transport (TIDAL_FAULT_TRANSPORT); default: the preset's (collective)")
    ap.add_argument("--rerun", nargs="+", default=None, metavar="FILE.py",
                    help="run only these test files again and replace their cases in the recorded campaign")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--write", type=Path, default=RESULTS_MD, metavar="FILE",
                    help="the markdown file whose section this replaces (default benchmarks/RESULTS.md)")
    ap.add_argument("--json-out", type=Path, default=None, metavar="FILE",
                    help="the figures' JSON file (default benchmarks/results/faults.json or faults_hf.json)")
    args = ap.parse_args(argv)
    if args.ranks is not None and not 1 <= args.ranks <= 8:
        ap.error(f"--ranks {args.ranks}: a rank count from 1 to 8")
    paths, section, name = PLATFORM if args.platform else CAMPAIGNS[args.preset]
    plane = {**({"TIDAL_FAULT_TRAINER_RANKS": str(args.ranks)} if args.ranks else {}),
             **({"TIDAL_FAULT_TRANSPORT": args.transport} if args.transport else {})}
    if args.transport == "object_store" and not args.platform:  # the collective's figures stay where they are
        section, name = f"{section}_object_store", f"{name}_object_store"
    out = args.json_out or RESULTS_DIR / f"{name}.json"
    before = None
    if args.rerun:
        try:
            before, paths = rerun_paths(out, args.rerun, args.ranks, args.transport)
        except ValueError as exc:
            ap.error(str(exc))
    with tempfile.TemporaryDirectory(prefix="tidal-faults-") as tmp:
        report, junit = Path(tmp) / "faults.jsonl", Path(tmp) / "junit.xml"
        cmd, code, took = run_pytest(args.preset, report, junit, extra, paths, plane)
        records = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
        cases = read_junit(junit) if junit.exists() else []
    reruns = []
    if before is not None:
        records, cases, took, code, reruns = merged(before, paths, records, cases, took, code)
    t = tally(records, cases)
    options = (([] if args.preset == "tiny-cpu" else ["--preset", args.preset]) + (["--platform"] if args.platform else [])
               + (["--ranks", str(args.ranks)] if args.ranks else [])
               + (["--transport", args.transport] if args.transport else []))
    if before is not None:
        options += ["--rerun", *paths]
    command = shlex.join([".venv/bin/python", "benchmarks/fault_campaign.py", *options, *(["--", *extra] if extra else [])])
    text = markdown(command, t, records, took, args.preset, args.platform, args.ranks, args.transport)
    if reruns:
        text += "".join(f"\nRun again: {', '.join(r['files'])} at {r['commit']} ({r['date']}, {r['seconds']:.0f} s), their "
                        f"cases replacing those of the campaign recorded at {r['campaign_commit']}; the seconds "
                        f"above add both.\n" for r in reruns)
    print(text)
    if not args.no_write:
        write_section(section, text, args.write)
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        print("wrote", write_json(name, {**t, "preset": args.preset, "command": command, "pytest_exit": code,
                                         "seconds": took, "commit": commit,
                                         "trainer_ranks": args.ranks or 1, "transport": args.transport or "collective",
                                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "records": records, "cases": cases,
                                         **({"reruns": reruns} if reruns else {})}, out))
        if args.platform and args.write == RESULTS_MD:  # faults.platform in results.json, as run_all.py merges it
            from run_all import write_summary

            print("wrote", write_summary())
    return code


if __name__ == "__main__":
    sys.exit(main())
