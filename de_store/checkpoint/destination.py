"""Checking where a checkpoint goes, before any work is done.

A save, ``de-store demo`` and ``de-store convert`` check their destination first, so that
one that cannot take the checkpoint fails at once, in one line, instead of after training
or after every shard was written:

- The URL's protocol must be served: opening the backend raises ``UnknownProtocolError``
  (one line, naming the protocol).
- On a local disk (:func:`check_destination`): the checkpoint path must not be a file. The
  folders missing on the way are created by the save, so the nearest one that exists must
  be a folder (not a file in the way) in which this process can create a file. That is
  tested by creating an unnamed temporary file there: permission bits say nothing for root,
  and a read-only mount shows only on a write.
- On other storage, with ``probe=True`` (the command line): an empty object is written under
  the checkpoint folder and deleted again, so that a missing bucket, missing credentials or
  a read-only account fail here. A library save skips this: its first write fails on the
  same problems, so nothing is written, and its storage calls stay the saver's own.
- :func:`check_reachable` (the command line): the storage server of an ``s3://``,
  ``gs://`` or ``http(s)://`` URL must accept a TCP connection, tried once with a timeout.
  Storage clients retry a refused connection for up to a minute (gcsfs six times with
  backoff); the command line says at once that the server cannot be reached.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import urllib.parse
from collections.abc import Mapping
from typing import Any

import fsspec

from de_store.backends.base import Backend
from de_store.backends.location import Location
from de_store.checkpoint import names
from de_store.checkpoint.retry import NO_RETRY, RetryPolicy
from de_store.errors import DestinationError, StorageUnreachableError

#: Environment variables naming a proxy: the storage client goes through it, not direct.
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")


def check_destination(
    backend: Backend, name: str, *, probe: bool = False, retry: RetryPolicy = NO_RETRY
) -> None:
    """Raise :class:`DestinationError` if the checkpoint ``name`` cannot be written there.

    Parameters
    ----------
    backend:
        The parent location of the checkpoint.
    name:
        The checkpoint's folder inside ``backend``.
    probe:
        On storage other than a local disk, write an empty object under ``name`` and
        delete it (local disks are always checked, at no storage cost).
    retry:
        How the probe's write and delete are retried on a transient error.
    """
    path = backend.local_path(name)
    where = Location(backend, name).url
    if path is not None:
        _check_local(os.path.abspath(path), where)
    elif probe:
        _probe_remote(backend, name, where, retry)


def _check_local(path: str, where: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise DestinationError(
            f"cannot save checkpoint {where}: {path} is a file, expected a folder (or nothing)"
        )
    folder = os.path.dirname(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise DestinationError(
            f"cannot save checkpoint {where}: {folder} is a file, so the folders of "
            f"{path} cannot be created in it"
        )
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=names.PROBE_PREFIX):
            pass
    except OSError as err:
        raise DestinationError(
            f"cannot save checkpoint {where}: folder {folder} is not writable "
            f"({type(err).__name__}: {err.strerror or err})"
        ) from err


def _probe_remote(backend: Backend, name: str, where: str, retry: RetryPolicy) -> None:
    probe = backend.join(name, names.probe_name())
    try:
        retry.call(lambda: backend.write_bytes(probe, b""))
    except Exception as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DestinationError(
            f"cannot save checkpoint {where}: writing a test object there failed: {first_line}"
        ) from err
    retry.call(lambda: backend.delete(probe))


def check_reachable(
    url: str, storage_options: Mapping[str, Any] | None = None, timeout_s: float = 10.0
) -> None:
    """Raise :class:`StorageUnreachableError` if the storage server of ``url`` refuses a
    connection or its name does not resolve; tried once, within ``timeout_s``.

    Checked before the storage client is built (finding GCS credentials alone probes the
    network for a quarter of a minute). Only for S3, GCS and HTTP(S) URLs, and not when a
    proxy is configured (the client then connects to the proxy); other URLs pass.
    """
    endpoint = storage_endpoint(url, storage_options or {})
    if endpoint is None or any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return
    parsed = urllib.parse.urlsplit(endpoint if "//" in endpoint else f"http://{endpoint}")
    host = parsed.hostname or ""
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with contextlib.closing(socket.create_connection((host, port), timeout=timeout_s)):
            pass
    except OSError as err:
        raise StorageUnreachableError(
            f"cannot reach the storage server {host}:{port} of {url}: "
            f"{err.strerror or err} (check the network, or the endpoint_url storage option)"
        ) from err


def storage_endpoint(url: str, storage_options: Mapping[str, Any]) -> str | None:
    """The server (``scheme://host[:port]``) the storage client of ``url`` talks to, as
    gcsfs and s3fs choose it, where one is known."""
    protocol = fsspec.core.split_protocol(url)[0]
    client_kwargs = storage_options.get("client_kwargs") or {}
    if protocol in ("gs", "gcs"):
        return (
            storage_options.get("endpoint_url")
            or os.environ.get("STORAGE_EMULATOR_HOST")
            or "https://storage.googleapis.com"
        )
    if protocol in ("s3", "s3a"):
        return (
            storage_options.get("endpoint_url")
            or client_kwargs.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or "https://s3.amazonaws.com"
        )
    if protocol in ("http", "https"):
        return url
    return None
