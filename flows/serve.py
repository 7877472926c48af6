"""Serve the `training-run` deployments without a work pool: ``python -m flows.serve``.

Owns: reading ``deployments/prefect.yaml``, refusing a deployment whose config does not load or
whose name a work pool holds (exit 2), and one Ctrl-C to stop. Must not: define deployments of its
own. Details: ``docs/flows.md``.

    python -m flows.serve                       # every deployment in prefect.yaml
    python -m flows.serve --only tiny-cpu       # just this one (repeatable)
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from flows.errors import EXIT_BAD_INPUT

PREFECT_YAML = Path(__file__).resolve().parents[1] / "deployments" / "prefect.yaml"
FLOW_NAME = "training-run"


def deployment_specs(path: Path = PREFECT_YAML, only: list[str] | None = None) -> list[dict[str, Any]]:
    """The `deployments:` entries of prefect.yaml (anchors resolved), optionally filtered by name."""
    specs = yaml.safe_load(path.read_text(encoding="utf-8"))["deployments"]
    names = [s["name"] for s in specs]
    unknown = sorted(set(only or []) - set(names))
    if unknown:
        raise SystemExit(f"flows.serve: unknown deployment(s) {unknown}; known: {names}")
    return [s for s in specs if not only or s["name"] in only]


def config_errors(specs: list[dict[str, Any]]) -> list[str]:
    """One line per deployment whose ``config`` and ``overrides`` do not load (as ``tidal run``
    would check them), so that a broken deployment is refused before anything is served."""
    from config import ConfigError
    from flows.configs import load_checked

    errors = []
    for spec in specs:
        params = spec.get("parameters") or {}  # a missing parameter takes the flow's default
        try:
            load_checked(params.get("config", "tiny-cpu"), list(params.get("overrides") or []))
        except ConfigError as exc:
            errors.append(f"{FLOW_NAME}/{spec['name']}: {' '.join(str(exc).split())}")
    return errors


def pool_bound(names: list[str]) -> list[str]:
    """Those of ``training-run/<name>`` that already exist on the server bound to a work pool."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    bound = []
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                deployment = client.read_deployment_by_name(f"{FLOW_NAME}/{name}")
            except ObjectNotFound:
                continue
            if deployment.work_pool_name:
                bound.append(f"{FLOW_NAME}/{name}")
    return bound


def build_deployments(specs: list[dict[str, Any]]) -> list[Any]:
    from flows.training_run import training_run

    return [
        training_run.to_deployment(
            name=s["name"], parameters=s.get("parameters") or {}, tags=s.get("tags") or [],
            description=s.get("description"),
        )
        for s in specs
    ]


def _interrupt(signum: int, frame: Any) -> None:
    # Installed instead of Python's default SIGINT handler so that asyncio does not install its
    # own: after the runner has run a flow, asyncio's task-cancelling handler is absorbed and the
    # first Ctrl-C is lost. Raising here stops `serve` on the first Ctrl-C, always.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="Serve only this deployment name (repeatable).")
    parser.add_argument("--limit", type=int, default=1, help="Runs at once (default 1: a run owns its Ray cluster).")
    args = parser.parse_args(argv)
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        print("flows.serve: set PREFECT_API_URL to a running Prefect server first", file=sys.stderr)
        return EXIT_BAD_INPUT
    specs = deployment_specs(only=args.only)
    broken = config_errors(specs)
    if broken:
        print(f"flows.serve: bad config in {'; '.join(broken)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    taken = pool_bound([s["name"] for s in specs])
    if taken:
        print(f"flows.serve: {', '.join(taken)} already deployed to a work pool on this server; free the "
              f"name(s) first with `prefect deployment delete '<name>'` (or serve others with --only)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    from prefect import serve

    deployments = build_deployments(specs)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        serve(*deployments, limit=args.limit)  # returns after SIGTERM, or raises/returns on SIGINT
    except KeyboardInterrupt:
        print("flows.serve: interrupted, stopped serving", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
