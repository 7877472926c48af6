"""Free loopback ports for the servers this process starts (Ray heads, Prefect servers, PostgreSQL).

A port found free by binding port 0 stays free only until someone else binds it, and the servers
we start bind their ports seconds later. Two servers started by one process could therefore be
handed the same port: a CI run lost a Ray head that way, its runtime-env agent finding its port
taken by a PostgreSQL the test had started in the meantime. ``free_port`` never hands out the same
port twice in one process; ``wait_listening`` lets a starter hold on until its server has bound
every port it was given, so that no other process can take one of them from it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

_handed_out: set[int] = set()
_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now and that this process has not handed out."""
    with _lock:
        for _ in range(64):
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free port on {host} after 64 tries")


def listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def wait_listening(ports: list[int], deadline: float, host: str = "127.0.0.1",
                   alive: Callable[[], bool] = lambda: True) -> list[int]:
    """Wait until every port accepts connections, ``alive()`` turns false or ``time.monotonic()``
    passes ``deadline``; returns the ports that are still not listening."""
    pending = list(ports)
    while pending and alive() and time.monotonic() < deadline:
        pending = [p for p in pending if not listening(p, host)]
        if pending:
            time.sleep(0.25)
    return pending


def listen_on(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only, as a file descriptor for a server that would
    otherwise bind every interface (``torch.distributed.TCPStore(master_listen_fd=...)``); the
    server owns it from then on."""
    family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(where)
        listener.listen(128)
        return listener.detach()
    finally:
        listener.close()  # a no-op once detached

