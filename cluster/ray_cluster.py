"""Starting or attaching to the Ray cluster a run uses, without touching anyone else's.

A run either attaches to ``ray.address`` or starts a local cluster it owns: its own temp dir
(short path — Ray's unix sockets cap the length), its own free ports, explicit memory limits
(Ray over-counts memory on these machines), ``RAY_AUTH_MODE`` set explicitly, and the emulated
GPU resource ``tidal_gpu`` (one per emulated GPU) so actors are placed like on a real cluster.
Asked to (``ray_gpus``), it advertises Ray's own ``GPU`` too, real or not: placement then treats
it as a GPU cluster (cluster/placement.py) and asks ``num_gpus`` of it.
Nothing here ever stops Ray machine-wide: the owner shuts down only the cluster it started.

Loopback only: a cluster started here is a single-machine cluster, and every one of its listeners
(GCS, raylet and object manager, dashboard and runtime-env agents, client server, workers' gRPC
ports) binds 127.0.0.1. Ray 2.60 has no bind-address option; what it has is single-machine mode
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, on by default on Windows and macOS), under which the
node's IP is the loopback address and the servers bind that address. Every process of the cluster,
drivers included, must agree on it: the head and its workers get it in their environment, and
``use_loopback_ray`` puts this process in it (``LocalRayCluster.start`` and ``init_ray`` call it
for the clusters they start or reach on a loopback address). Attaching to a multi-node cluster by
a non-loopback address leaves Ray's defaults alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cluster.ports import free_port, wait_listening

GPU_RESOURCE = "tidal_gpu"
"""Ray resource name of one emulated (or real) accelerator."""
LOOPBACK = "127.0.0.1"
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""``0``: Ray treats this machine as a one-node cluster whose IP is the loopback address."""
AUTOSCALER_PORT_ENV = "AUTOSCALER_METRIC_PORT"
"""The autoscaler monitor's metrics port, a fixed 44217 unless set: every cluster we start gets a
free one, so that two side by side (tests, benchmarks, another user's run) do not collide there."""


def _ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    return env


def is_loopback_address(address: str | None) -> bool:
    """Whether ``host:port`` names this machine's loopback interface."""
    if not address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def use_loopback_ray() -> None:
    """Put this process in Ray's single-machine mode (see the module docstring), before or after
    ``import ray``: the environment for what it starts, Ray's already-read constant for itself."""
    os.environ[SINGLE_MACHINE_ENV] = "0"
    import ray._private.ray_constants as ray_constants  # read at import; Ray's own helpers look it up at call time

    ray_constants.ENABLE_RAY_CLUSTER = False


@dataclass
class LocalRayCluster:
    """A Ray head started as a child process with its own temp dir and ports.

    Used by tests and by `tidal run` when no address is configured and a separate head is
    wanted (e.g. so that Prefect's Ray task runner can attach to it). ``stop()`` ends only this
    head's process group.
    """

    num_cpus: int = 2
    gpus: int = 2
    memory_gb: float = 4.0
    object_store_memory_gb: float = 0.5
    temp_dir: str | None = None
    port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the head (its workers inherit it), e.g. PYTHONPATH."""
    ray_gpus: int | None = None
    """Ray's own ``GPU`` count the head advertises (``--num-gpus``), real or not: with it a test
    places actors as on a GPU cluster (``num_gpus``, ``CUDA_VISIBLE_DEVICES``) on a machine
    without one. None: Ray detects them (none here)."""
    _proc: subprocess.Popen | None = None
    _owns_temp: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> LocalRayCluster:
        if self.temp_dir is None:
            self.temp_dir = new_temp_dir()
            self._owns_temp = True
        ports = [free_port() for _ in range(6)]
        use_loopback_ray()  # so that this process can connect to it (ray.init(address=self.address))
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            f"--port={self.port}", f"--temp-dir={self.temp_dir}", f"--node-ip-address={LOOPBACK}",
            f"--num-cpus={self.num_cpus}", f'--resources={{"{GPU_RESOURCE}": {self.gpus}}}',
            f"--memory={int(self.memory_gb * 2**30)}",
            f"--object-store-memory={int(self.object_store_memory_gb * 2**30)}",
            "--include-dashboard=false", "--disable-usage-stats",
            f"--node-manager-port={ports[0]}", f"--object-manager-port={ports[1]}",
            f"--ray-client-server-port={ports[2]}", f"--dashboard-agent-listen-port={ports[3]}",
            f"--dashboard-agent-grpc-port={ports[4]}", f"--runtime-env-agent-port={ports[5]}",
            "--min-worker-port=0", "--max-worker-port=0",
            *([f"--num-gpus={self.ray_gpus}"] if self.ray_gpus is not None else []),
        ]
        log = open(Path(self.temp_dir) / "head.log", "w")  # noqa: SIM115 - closed with the process
        env = {**_ray_env(), AUTOSCALER_PORT_ENV: str(free_port()), **self.env, SINGLE_MACHINE_ENV: "0"}
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # Wait until the head has bound every port it was given (GCS, raylet, object manager, client
        # server, both agents): until then another server started by this or any process could take
        # one, and the raylet dies with the agent that lost its port (cluster/ports.py).
        own = {"GCS": self.port, "node manager": ports[0], "object manager": ports[1],
               "client server": ports[2], "dashboard agent": ports[3], "dashboard agent gRPC": ports[4],
               "runtime-env agent": ports[5]}
        pending = wait_listening(list(own.values()), time.monotonic() + timeout_s,
                                 alive=lambda: self._proc.poll() is None)
        if self._proc.poll() is not None:
            raise RuntimeError(f"ray head exited with {self._proc.returncode}; see {log.name}")
        if pending:
            self.stop()
            names = ", ".join(f"{name} {port}" for name, port in own.items() if port in pending)
            raise TimeoutError(f"ray head {self.address} did not listen on {names} within {timeout_s:.0f}s")
        time.sleep(0.5)
        if self._proc.poll() is not None:
            raise RuntimeError(f"ray head exited with {self._proc.returncode}; see {log.name}")
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            import signal

            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
                self._proc.wait(timeout=8)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._proc = None
        if self._owns_temp and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def new_temp_dir() -> str:
    """A new temp dir for a local Ray cluster, directly under /tmp: Ray's unix sockets live in it,
    and their paths have a length limit."""
    return tempfile.mkdtemp(prefix="tidal-ray-", dir="/tmp")


def init_ray(*, address: str | None, num_cpus: int | None, gpus: int, memory_gb: float,
             object_store_memory_gb: float, temp_dir: str | None, namespace: str,
             ray_gpus: int | None = None) -> str | None:
    """Connect this process to Ray. Returns the temp dir of the local cluster it started (and so
    owns: shut it down, then delete that dir), or None when it attached to an existing one.
    ``gpus``: the emulated ``tidal_gpu`` of a local cluster; ``ray_gpus``: Ray's own ``GPU`` it
    advertises (None: what Ray detects)."""
    import ray

    for key, value in _ray_env().items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return None
    common = dict(namespace=namespace, log_to_driver=False, configure_logging=False)
    if address:
        if is_loopback_address(address):
            use_loopback_ray()
        with _keeping_sigterm_handler():
            ray.init(address=address, **common)
        return None
    use_loopback_ray()
    os.environ[AUTOSCALER_PORT_ENV] = str(free_port())  # read by the monitor this init starts
    owned = temp_dir or new_temp_dir()
    with _keeping_sigterm_handler():
        ray.init(
            address="local",  # a new cluster even where /tmp/ray/ray_current_cluster names another (or a dead) one
            num_cpus=num_cpus,
            num_gpus=ray_gpus,
            resources={GPU_RESOURCE: gpus},
            _temp_dir=owned,
            _memory=int(memory_gb * 2**30),
            object_store_memory=int(object_store_memory_gb * 2**30),
            include_dashboard=False,
            **common,
        )
    return None if temp_dir else owned


@contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """``ray.init`` in the main thread replaces the SIGTERM handler with ``sys.exit(15)``. Where a
    handler of ours or Prefect's was installed (the driver's stop handling: exit 143 and a resume
    line), put it back; a SIGTERM landing between two step flows otherwise exited with 15."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


def _forget_current_cluster(address: str | None) -> None:
    """Delete Ray's machine-wide ``ray_current_cluster`` file if it names ``address`` (the head
    ``ray.cluster_utils.Cluster`` wrote it for): a stale one makes every later ``ray.init()``
    without an address try to join the dead cluster."""
    from ray._private.utils import get_ray_address_file

    path = Path(get_ray_address_file(None))
    try:
        named = path.read_text(encoding="utf-8").strip()
    except OSError:
        return
    if address and named.rsplit(":", 1)[-1] == address.rsplit(":", 1)[-1]:
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class NodeSpec:
    """One node of a :class:`LocalMultiNodeCluster`: its emulated GPUs and labels."""

    gpus: int = 1
    labels: dict[str, str] = field(default_factory=dict)
    num_cpus: int = 1
    memory_gb: float = 1.0
    ray_gpus: int = 0
    """Ray's own ``GPU`` the node advertises, real or not (a GPU cluster's placement on CPUs)."""


class LocalMultiNodeCluster:
    """A Ray cluster of one head and several worker nodes on this machine (Ray's own
    ``ray.cluster_utils.Cluster``): every node a raylet of its own with its own ``tidal_gpu`` and
    Ray ``GPU`` counts, labels and ports, all on the loopback address, in one temp dir of ours. For
    tests and benchmarks of multi-node placement; ``stop()`` ends only these nodes' processes."""

    def __init__(self, head: NodeSpec, workers: list[NodeSpec], *, object_store_mb: int = 150,
                 health_check_s: float | None = None) -> None:
        self.head_spec, self.worker_specs, self.object_store_mb = head, list(workers), object_store_mb
        self.health_check_s = health_check_s
        """How soon the head declares a silent node dead: Ray's GCS health check, one probe a
        second, the node dead after ``health_check_s`` of failed ones. None: Ray's defaults (a probe
        every 3 s, dead after 5 failed: 15-30 s; ``RAY_health_check_period_ms`` and
        ``RAY_health_check_failure_threshold`` on a real head)."""
        self.temp_dir = tempfile.mkdtemp(prefix="tidal-mn-", dir="/tmp")
        self.cluster: object | None = None
        self.workers: list[object] = []

    def _node_args(self, spec: NodeSpec) -> dict[str, object]:
        return dict(num_cpus=spec.num_cpus, num_gpus=spec.ray_gpus,
                    resources={GPU_RESOURCE: spec.gpus} if spec.gpus else {},
                    labels=dict(spec.labels), memory=int(spec.memory_gb * 2**30),
                    object_store_memory=self.object_store_mb * 2**20, node_ip_address=LOOPBACK,
                    object_manager_port=free_port(), runtime_env_agent_port=free_port(),
                    dashboard_agent_listen_port=free_port(), metrics_agent_port=free_port())

    @property
    def address(self) -> str:
        return self.cluster.address  # type: ignore[union-attr]

    def start(self, attempts: int = 3) -> LocalMultiNodeCluster:
        """Start the head and the workers. Ray gives a node a fixed 30 s to register, which a
        loaded machine can miss: then everything started is ended and the start is tried again."""
        for attempt in range(attempts):
            try:
                return self._start()
            except Exception:  # noqa: BLE001 - "node timed out during startup", a port taken meanwhile
                self.stop(keep_temp=True)
                if attempt == attempts - 1:
                    raise
        return self

    def _start(self) -> LocalMultiNodeCluster:
        from ray._private.utils import get_ray_address_file
        from ray.cluster_utils import Cluster

        # Ray's Cluster writes the head's address to the machine-wide ray_current_cluster file in
        # Ray's default temp root, $RAY_TMPDIR or $TMPDIR or /tmp, + /ray (``stop`` deletes it),
        # whatever the head's own temp_dir, and fails (FileNotFoundError) where that folder is
        # missing: on a machine (or under a TMPDIR) where no Ray ever ran. So create it first. Ray
        # has no public name for that path: ray._private.utils.get_ray_address_file (private) is
        # the one Cluster itself writes to (tests/integration/test_multinode_fresh.py)
        Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
        use_loopback_ray()
        for key, value in _ray_env().items():  # the nodes inherit this process's environment
            os.environ.setdefault(key, value)
        os.environ[AUTOSCALER_PORT_ENV] = str(free_port())
        head = {**self._node_args(self.head_spec), "temp_dir": self.temp_dir, "gcs_server_port": free_port(),
                "include_dashboard": False, "ray_client_server_port": free_port()}
        if self.health_check_s is not None:
            head["_system_config"] = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                                      "health_check_timeout_ms": 1000,
                                      "health_check_failure_threshold": max(1, round(self.health_check_s))}
        # shutdown_at_exit: a node whose start failed half-way is still ended when this process exits
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.workers = []
        for spec in self.worker_specs:
            self.workers.append(self.add_worker(spec))
        return self

    def add_worker(self, spec: NodeSpec) -> object:
        """Start one more worker node; returns Ray's node object (its ``node_id``, for ``remove``)."""
        node = self.cluster.add_node(**self._node_args(spec))  # type: ignore[union-attr]
        self.cluster.wait_for_nodes()  # type: ignore[union-attr]
        return node

    def remove(self, node: object) -> None:
        """Take a worker node away, as a machine that dies (its processes are killed)."""
        self.cluster.remove_node(node, allow_graceful=False)  # type: ignore[union-attr]
        if node in self.workers:
            self.workers.remove(node)

    def node_pids(self, node: object) -> list[int]:
        """The processes of worker node ``node``, all started here: the ones Ray's ``Node`` started
        (raylet, agents, log monitor...) and every descendant of its raylet (its worker processes,
        the actors of that node among them)."""
        import psutil

        pids: list[int] = []
        for infos in node.all_processes.values():  # type: ignore[attr-defined]
            for info in infos:
                if info.process.poll() is None:
                    pids.append(info.process.pid)
                    try:
                        pids.extend(c.pid for c in psutil.Process(info.process.pid).children(recursive=True))
                    except psutil.NoSuchProcess:
                        pass
        return sorted(set(pids))

    def kill(self, node: object) -> list[int]:
        """Lose worker node ``node`` as a machine that dies: SIGKILL its raylet and every process
        of it at once, by pid (``node_pids``: only this node's), then reap them. Nothing of the
        node says goodbye: the head learns of the loss by its health check
        (``health_check_s``). Returns the pids killed."""
        import signal

        pids = self.node_pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # reap the node's own children (raylet and the rest; its workers were the raylet's)
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)  # type: ignore[attr-defined]
        self.cluster.worker_nodes.discard(node)  # type: ignore[union-attr]
        if node in self.workers:
            self.workers.remove(node)
        return pids

    def stop(self, *, keep_temp: bool = False) -> None:
        if self.cluster is not None:
            address = self.cluster.address  # type: ignore[union-attr]
            for node in [*self.workers]:
                self.remove(node)
            head = self.cluster.head_node  # type: ignore[union-attr]
            if head is not None:
                self.cluster.remove_node(head)  # type: ignore[union-attr]
            self.cluster = None
            _forget_current_cluster(address)
        if not keep_temp:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalMultiNodeCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
