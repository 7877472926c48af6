"""Run one probe phase through each task runner the step flow can use; print where it ran as JSON.

    python tests/e2e/runner_probe.py RAY_TEMP_DIR      (PREFECT_API_URL must name a running server)

Sets up Ray the way `training_run` does (``init_ray`` → a local cluster owned by this process, a
named actor in the run's namespace), then runs a flow with ``task_runner_for`` + ``run_phase``
once per runner kind, four phases each. The probe reports its process, whether it is a Ray worker,
which cluster it is attached to, the answer of the run's actor (found by name like the real
phases do) and which Prefect API client it ran with.
"""

from __future__ import annotations

import json
import os
import sys

import ray
from prefect import flow, task

from cluster.ray_cluster import init_ray
from config import load_config
from flows.runners import run_phase, task_runner_for

NAMESPACE = "probe-run"
PHASES = 4


@ray.remote(num_cpus=0)
class Marker:
    def pid(self) -> int:
        return os.getpid()


@task(name="probe")
def probe(namespace: str) -> dict:
    from prefect.context import SyncClientContext

    context = ray.get_runtime_context()
    actor = ray.get_actor("marker", namespace=namespace)
    return {"pid": os.getpid(), "ray_worker": context.worker.mode == ray.WORKER_MODE,
            "gcs_address": context.gcs_address, "actor_pid": ray.get(actor.pid.remote()),
            "client": id(SyncClientContext.get().client)}


def main(temp_dir: str) -> None:
    owns = init_ray(address=None, num_cpus=2, gpus=1, memory_gb=2.0, object_store_memory_gb=0.3,
                    temp_dir=temp_dir, namespace=NAMESPACE)
    try:
        marker = Marker.options(name="marker", namespace=NAMESPACE).remote()
        out = {"driver_pid": os.getpid(), "gcs_address": ray.get_runtime_context().gcs_address,
               "actor_pid": ray.get(marker.pid.remote())}
        for kind in ("ray", "thread"):
            cfg = load_config("tiny-cpu", [f"prefect.task_runner={kind}"])
            runner = task_runner_for(cfg, out["gcs_address"])

            @flow(name="runner-probe", flow_run_name=f"probe-{kind}", task_runner=runner)
            def probe_flow() -> list[dict]:
                return [run_phase(probe, NAMESPACE) for _ in range(PHASES)]

            first, *rest = probe_flow()
            out[kind] = {**first, "runner": type(runner).__name__, "rest": rest}
        print("PROBE " + json.dumps(out), flush=True)
    finally:
        if owns:
            ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
