"""Real S3 and GCS servers on 127.0.0.1 for tests and benchmarks.

``start_moto_server`` runs moto's S3 server, ``start_gcs_emulator`` the
``gcp-storage-emulator``; both listen on a free port and return ``(endpoint_url, stop)``.
``reset_*`` wipes every bucket between tests. Nothing mocks an S3 or GCS call: s3fs and
gcsfs talk HTTP to these servers exactly as they would to the cloud.

Facts these helpers encode: s3fs must get no ``region_name`` against moto; gcsfs must see
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` before it is imported, or every call against
the emulator stalls about 60 s.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from de_store.backends import Backend, open_backend

#: Credentials moto accepts; they reach no real account.
MOTO_CREDENTIALS = {"key": "testing", "secret": "testing"}


@dataclasses.dataclass(frozen=True)
class StorageLocation:
    """A URL plus the ``storage_options`` needed to reach it.

    Attributes
    ----------
    name:
        Short backend name ("local", "memory", "s3", "gcs"), handy in test ids.
    url:
        The location, e.g. ``s3://test-bucket/prefix``.
    storage_options:
        Passed to fsspec (endpoint, credentials); empty for local and memory.
    """

    name: str
    url: str
    storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def open(self, root: str | None = None) -> Backend:
        """Open this location as a backend (optionally under the sub-path ``root``)."""
        return open_backend(self.url, dict(self.storage_options), root=root)


def s3_storage_options(endpoint_url: str) -> dict[str, Any]:
    """s3fs options for a moto server: endpoint and dummy credentials, no region."""
    return {"endpoint_url": endpoint_url, **MOTO_CREDENTIALS}


def gcs_storage_options(endpoint_url: str) -> dict[str, Any]:
    """gcsfs options for a gcp-storage-emulator server: endpoint and anonymous token."""
    return {"endpoint_url": endpoint_url, "token": "anon", "project": "de-store-test"}


def free_port() -> int:
    """A TCP port free on this machine at the time of the call (see ``free_ports``)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on this machine at the time of the call.

    They are drawn at random below the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``): between this call and the moment a
    server binds one, no outgoing connection of any process takes it, as one could a
    port the kernel hands out for ``bind(port 0)``. A port counts as free when it can be
    bound on every IPv4 and IPv6 address.
    """
    low = _ephemeral_low()
    if low is None or low - _FIRST_PORT < 4 * count:
        return _kernel_ports(count)
    ports: list[int] = []
    draw = random.SystemRandom()
    for port in draw.sample(range(_FIRST_PORT, low), low - _FIRST_PORT):
        if _bindable(port):
            ports.append(port)
            if len(ports) == count:
                return ports
    raise OSError(f"only {len(ports)} of {count} ports free in {_FIRST_PORT}-{low - 1}")


#: The lowest port ``free_ports`` draws; those below are often taken by system services.
_FIRST_PORT = 10000


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range, or None where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine
            continue
        with sock:
            try:
                sock.bind((host, port))
            except OSError as error:
                if error.errno == errno.EADDRINUSE or family == socket.AF_INET:
                    return False
    return True


def _kernel_ports(count: int) -> list[int]:
    """``count`` distinct ports the kernel picks (the sockets are held until all are
    picked, so no two are the same)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _wait_until_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"server at {url} did not answer within {timeout} s") from None
            time.sleep(0.05)


def start_moto_server(*, in_process: bool = True) -> tuple[str, Callable[[], None]]:
    """Start moto's S3 server on 127.0.0.1 and a free port.

    Parameters
    ----------
    in_process:
        Run it in a thread of this process (fast to start). False runs it in a
        subprocess so that it does not share this process's GIL (for benchmarks).

    Returns
    -------
    (endpoint_url, stop)
    """
    if not in_process:
        port = free_port()
        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        return _start_subprocess(cmd, f"http://127.0.0.1:{port}", "/moto-api/")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return f"http://{host}:{port}", server.stop


def _start_subprocess(
    cmd: list[str], endpoint: str, health_path: str
) -> tuple[str, Callable[[], None]]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    try:
        _wait_until_up(endpoint + health_path)
    except BaseException:
        stop()
        raise
    return endpoint, stop


def reset_moto_server(endpoint_url: str) -> None:
    """Delete every bucket and object of the moto server at ``endpoint_url``."""
    request = urllib.request.Request(f"{endpoint_url}/moto-api/reset", method="POST")
    with urllib.request.urlopen(request, timeout=30):
        pass


def start_gcs_emulator() -> tuple[str, Callable[[], None]]:
    """Start an in-memory gcp-storage-emulator on 127.0.0.1 and a free port.

    Returns
    -------
    (endpoint_url, stop)
    """
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    _wait_until_up(endpoint + "/")
    return endpoint, server.stop


def reset_gcs_emulator(endpoint_url: str) -> None:
    """Delete every bucket and object of the emulator at ``endpoint_url``."""
    with urllib.request.urlopen(f"{endpoint_url}/wipe", timeout=30):
        pass


def create_bucket(protocol: str, bucket: str, storage_options: dict[str, Any]) -> None:
    """Create ``bucket`` on the S3 (``"s3"``) or GCS (``"gs"``) server of the options."""
    backend = open_backend(f"{protocol}://", dict(storage_options))
    fs = backend.fs  # type: ignore[attr-defined]
    fs.invalidate_cache()
    fs.mkdir(bucket)
