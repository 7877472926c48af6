"""Serve the `training-run` deployments without a work pool: ``python -m flows.serve``.

The deployments (names, parameters, tags, descriptions) are read from ``deployments/prefect.yaml``
so that both ways of deploying offer the same ones. Needs a Prefect server (``PREFECT_API_URL``).
Stop it with Ctrl-C (SIGINT): Prefect's runner then cancels its in-flight runs and exits 0.

    python -m flows.serve                       # every deployment in prefect.yaml
    python -m flows.serve --only tiny-cpu       # just this one (repeatable)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

PREFECT_YAML = Path(__file__).resolve().parents[1] / "deployments" / "prefect.yaml"


def deployment_specs(path: Path = PREFECT_YAML, only: list[str] | None = None) -> list[dict[str, Any]]:
    """The `deployments:` entries of prefect.yaml (anchors resolved), optionally filtered by name."""
    specs = yaml.safe_load(path.read_text(encoding="utf-8"))["deployments"]
    names = [s["name"] for s in specs]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise SystemExit(f"flows.serve: unknown deployment(s) {unknown}; known: {names}")
    return [s for s in specs if not only or s["name"] in only]


def build_deployments(specs: list[dict[str, Any]]) -> list[Any]:
    from flows.training_run import training_run

    return [
        training_run.to_deployment(
            name=s["name"], parameters=s.get("parameters") or {}, tags=s.get("tags") or [],
            description=s.get("description"),
        )
        for s in specs
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="Serve only this deployment name (repeatable).")
    parser.add_argument("--limit", type=int, default=1, help="Runs at once (default 1: a run owns its Ray cluster).")
    args = parser.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        from prefect.settings import PREFECT_API_URL

        if not PREFECT_API_URL.value():
            print("flows.serve: set PREFECT_API_URL to a running Prefect server first", file=sys.stderr)
            return 2
    from prefect import serve

    deployments = build_deployments(deployment_specs(only=args.only))
    try:
        serve(*deployments, limit=args.limit)  # returns after SIGINT/SIGTERM, runs cancelled
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
