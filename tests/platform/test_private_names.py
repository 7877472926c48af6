"""Every private Prefect or Ray name Tidal relies on, resolved here as the code uses it.

One test per name (docs/platform-notes.md, "Private Prefect and Ray names we use"): it imports
exactly that name and checks the shape the code relies on, and its message says what breaks in
Tidal when a Prefect or Ray upgrade changes it. Fast: no server, no Ray cluster.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest

# ------------------------------------------------------------------------------------------------
# production code (flows/, cluster/)
# ------------------------------------------------------------------------------------------------


def test_ray_task_runner_runs_each_task_through_the_static_run_prefect_task_we_override():
    from prefect_ray import RayTaskRunner

    from flows.runners import PhaseRayTaskRunner

    broke = ("flows.runners.PhaseRayTaskRunner overrides RayTaskRunner._run_prefect_task; without it every "
             "phase on the Ray runner rebuilds Prefect's settings and opens a new API client on its worker")
    assert isinstance(RayTaskRunner.__dict__.get("_run_prefect_task"), staticmethod), broke
    assert isinstance(PhaseRayTaskRunner.__dict__["_run_prefect_task"], staticmethod), broke
    assert "self._run_prefect_task" in inspect.getsource(RayTaskRunner.submit), broke
    params = inspect.signature(RayTaskRunner._run_prefect_task).parameters
    assert next(iter(params.values())).kind is inspect.Parameter.VAR_POSITIONAL, broke
    assert {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY} >= {
        "task", "task_run_id", "context", "parameters", "wait_for", "dependencies"}, broke


def test_a_serialized_task_context_carries_its_settings_under_settings_context_with_the_api_url():
    from prefect.context import SettingsContext, hydrated_context, serialize_context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    broke = ("flows.runners.PhaseRayTaskRunner pops context['settings_context'] and reads settings.api.url; "
             "renamed, its worker's cached client is built under the worker's default settings (the wrong API)")
    url = "http://127.0.0.1:9/api"
    with temporary_settings(updates={PREFECT_API_URL: url}):
        serialized = serialize_context()["settings_context"]
    assert serialized["settings"]["api"]["url"] == url, broke
    assert SettingsContext(**serialized).settings.api.url == url, broke
    assert '"settings_context"' in inspect.getsource(hydrated_context), broke


@pytest.fixture
def prefect_sqlite(monkeypatch):
    """Prefect's server database configuration module, its ``begin_sqlite_stmt`` restored after."""
    from prefect.server.database import configurations

    sqlite = configurations.AioSqliteConfiguration
    monkeypatch.setattr(sqlite, "begin_sqlite_stmt", sqlite.begin_sqlite_stmt)  # restored at teardown
    return configurations


class _Conn:
    def __init__(self) -> None:
        self.sql: list[str] = []

    def exec_driver_sql(self, statement: str) -> None:
        self.sql.append(statement)


def test_prefects_sqlite_begin_hook_and_mode_are_there_for_begin_immediate_to_replace(prefect_sqlite):
    from flows.prefect_app import begin_immediate

    broke = ("flows.prefect_app.begin_immediate replaces AioSqliteConfiguration.begin_sqlite_stmt (by "
             "SQLITE_BEGIN_MODE); without it Tidal's SQLite Prefect server answers 503 and a step stalls 2 s")
    sqlite, mode = prefect_sqlite.AioSqliteConfiguration, prefect_sqlite.SQLITE_BEGIN_MODE
    assert list(inspect.signature(sqlite.begin_sqlite_stmt).parameters) == ["self", "conn"], broke
    registered = 'event.listen(engine.sync_engine, "begin", self.begin_sqlite_stmt)'
    assert registered in inspect.getsource(sqlite.engine), broke  # looked up on the class: the patch applies
    assert '"DEFERRED"' in inspect.getsource(sqlite.begin_transaction), broke
    assert begin_immediate() is True, broke
    emitted = {}
    for value in ("DEFERRED", "IMMEDIATE", None):
        token, conn = mode.set(value), _Conn()
        try:
            sqlite.begin_sqlite_stmt(object(), conn)
        finally:
            mode.reset(token)
        emitted[value] = conn.sql
    assert emitted == {"DEFERRED": ["BEGIN IMMEDIATE"], "IMMEDIATE": ["BEGIN IMMEDIATE"], None: []}, broke


def test_rays_single_machine_constant_is_read_when_a_node_ip_is_looked_up(monkeypatch):
    import ray
    import ray._private.ray_constants as ray_constants
    import ray._private.services as services

    from cluster.ray_cluster import SINGLE_MACHINE_ENV, use_loopback_ray

    broke = ("cluster.ray_cluster.use_loopback_ray sets ray._private.ray_constants.ENABLE_RAY_CLUSTER after "
             "`import ray`; without it the driver's node IP is not 127.0.0.1 and it cannot join a loopback cluster")
    assert isinstance(ray_constants.ENABLE_RAY_CLUSTER, bool), broke
    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR == SINGLE_MACHINE_ENV, broke
    assert "ray_constants.ENABLE_RAY_CLUSTER" in inspect.getsource(services.get_node_ip_address), broke
    if ray.is_initialized():
        pytest.skip("a Ray node of this process answers get_node_ip_address first")
    monkeypatch.setenv(SINGLE_MACHINE_ENV, "1")  # both restored at teardown
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    use_loopback_ray()
    assert services.get_node_ip_address() == "127.0.0.1", broke


def test_rays_address_file_is_where_ray_cluster_utils_cluster_writes_the_current_cluster():
    import ray.cluster_utils
    from ray._private.utils import get_ray_address_file, write_ray_address

    broke = ("cluster.ray_cluster reads ray._private.utils.get_ray_address_file for the file ray.cluster_utils."
             "Cluster writes; moved, a stale one makes later ray.init() join a dead cluster (and a fresh "
             "machine fails LocalMultiNodeCluster)")
    assert Path(get_ray_address_file(None)).parts[-2:] == ("ray", "ray_current_cluster"), broke
    assert "get_ray_address_file" in inspect.getsource(write_ray_address), broke
    assert "write_ray_address" in inspect.getsource(ray.cluster_utils.Cluster), broke


def test_rays_node_keeps_its_processes_where_the_node_loss_fault_kills_them():
    import ray._private.node as node
    import ray.cluster_utils
    from ray._private.services import ProcessInfo

    broke = ("cluster.ray_cluster.LocalMultiNodeCluster.node_pids/kill read a worker Node's all_processes "
             "(ProcessInfo.process) and call Node.kill_all_processes, then drop it from Cluster.worker_nodes; "
             "changed, the Ray-node-loss fault (tests/faults/test_fault_ray_node.py) kills nothing or leaks the node")
    assert "self.all_processes" in inspect.getsource(node.Node.__init__), broke
    assert "process" in ProcessInfo._fields, broke
    assert {"check_alive", "allow_graceful", "wait"} <= set(inspect.signature(node.Node.kill_all_processes).parameters), broke
    assert "self.worker_nodes" in inspect.getsource(ray.cluster_utils.Cluster.__init__), broke


# ------------------------------------------------------------------------------------------------
# what replaced a private name
# ------------------------------------------------------------------------------------------------


def test_a_step_run_is_named_from_the_flows_public_flow_run_name_as_prefect_names_it():
    from flows.step_runs import run_name
    from flows.training_step import training_step

    step = {"run": types.SimpleNamespace(uid="r1"), "step": 7}
    assert run_name(training_step, step) == "r1-step-00007"
    assert run_name(training_step.with_options(flow_run_name=lambda: "by-callable"), step) == "by-callable"
    unnamed = training_step.with_options()
    unnamed.flow_run_name = None
    assert run_name(unnamed, step) is None


# ------------------------------------------------------------------------------------------------
# tests and benchmarks only
# ------------------------------------------------------------------------------------------------


def test_every_actor_method_call_goes_through_actor_method_remote_underscore():
    from ray.actor import ActorMethod

    broke = ("benchmarks/ray_call_counter.py counts ActorMethod._remote calls; if .remote() stops going "
             "through it, bench_control_plane reports 0 Ray calls per step")
    assert callable(ActorMethod.__dict__.get("_remote")), broke
    assert "self._remote(" in inspect.getsource(ActorMethod.remote), broke
    assert "_remote(" in inspect.getsource(ActorMethod.options), broke


def test_rays_private_actor_table_and_actor_id_are_there_for_the_multinode_checks():
    import ray._private.state as state
    from ray.actor import ActorHandle

    broke = ("tests/integration/test_multinode.py and benchmarks/bench_multinode.py read ray._private.state"
             ".actors(), test_weight_sync_plane ActorHandle._actor_id; without them they fail")
    assert callable(state.actors), broke
    assert isinstance(ActorHandle.__dict__.get("_actor_id"), property), broke
