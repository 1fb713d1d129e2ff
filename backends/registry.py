"""Lazy registry: URL protocol -> backend class (imported on first use) + package to install.

Protocols not listed here fall back to :class:`~de_store.backends.fsspec_generic.FsspecBackend`
when fsspec knows them; fsspec imports their implementation only when a URL is opened.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any

import fsspec
from fsspec.registry import known_implementations
from fsspec.spec import AbstractFileSystem

from de_store.errors import MissingDependencyError, UnknownProtocolError

from ._io import redact_url
from .base import Backend
from .fsspec_generic import FsspecBackend, first_protocol
from .options import check_storage_options


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """Where to find the backend class for a protocol.

    Attributes
    ----------
    class_path:
        Dotted path of the :class:`Backend` subclass, imported on first use.
    package:
        The pip package that implements the protocol, or None when fsspec has it built in.
    module:
        The module that package installs (checked before importing the backend class).
    """

    class_path: str
    package: str | None = None
    module: str | None = None


_GENERIC = "de_store.backends.fsspec_generic.FsspecBackend"
_LOCAL = BackendSpec("de_store.backends.local.LocalBackend")
_S3 = BackendSpec("de_store.backends.s3.S3Backend", "s3fs", "s3fs")
_GCS = BackendSpec("de_store.backends.gcs.GCSBackend", "gcsfs", "gcsfs")
_ADL = BackendSpec(_GENERIC, "adlfs", "adlfs")

registry: dict[str, BackendSpec] = {
    "file": _LOCAL,
    "local": _LOCAL,
    "memory": BackendSpec("de_store.backends.memory.MemoryBackend"),
    "s3": _S3,
    "s3a": _S3,
    "gs": _GCS,
    "gcs": _GCS,
    "abfs": _ADL,
    "abfss": _ADL,
    "az": _ADL,
    "hdfs": BackendSpec(_GENERIC, "pyarrow", "pyarrow"),
    "sftp": BackendSpec(_GENERIC, "paramiko", "paramiko"),
    "http": BackendSpec(_GENERIC, "aiohttp", "aiohttp"),
    "https": BackendSpec(_GENERIC, "aiohttp", "aiohttp"),
}


def register_backend(protocol: str, spec: BackendSpec, *, clobber: bool = False) -> None:
    """Serve ``protocol`` with the backend class named by ``spec``.

    Raises ``ValueError`` if the protocol is registered already and ``clobber`` is false.
    """
    if protocol in registry and not clobber:
        raise ValueError(f"protocol {protocol!r} is registered already: {registry[protocol]}")
    registry[protocol] = spec


def _spec_for(protocol: str) -> BackendSpec:
    spec = registry.get(protocol)
    if spec is not None:
        return spec
    if protocol not in known_implementations and protocol not in fsspec.registry:
        raise UnknownProtocolError(
            f"unknown storage protocol {protocol!r}: neither de_store nor fsspec serves it "
            "(fsspec.available_protocols() lists the known ones)"
        )
    return BackendSpec(_GENERIC, None, None)


def backend_class(protocol: str) -> type[Backend]:
    """The backend class serving ``protocol``, checking its package is installed.

    Raises
    ------
    UnknownProtocolError
        Neither this registry nor fsspec knows ``protocol``.
    MissingDependencyError
        The package implementing ``protocol`` is not installed; the message names it.
    """
    spec = _spec_for(protocol)
    if spec.module is not None and importlib.util.find_spec(spec.module) is None:
        raise MissingDependencyError(
            f"protocol {protocol!r} needs the package {spec.package!r}: pip install {spec.package}"
        )
    module_name, _, class_name = spec.class_path.rpartition(".")
    cls: type[Backend] = getattr(importlib.import_module(module_name), class_name)
    return cls


def open_backend(
    url_or_fs: str | AbstractFileSystem,
    storage_options: dict[str, Any] | None = None,
    *,
    root: str | None = None,
) -> Backend:
    """Open a storage location as a :class:`Backend`.

    Parameters
    ----------
    url_or_fs:
        A URL fsspec understands (``/plain/path``, ``file://``, ``memory://``, ``s3://``,
        ``gs://``, ...) or an already-built fsspec filesystem.
    storage_options:
        Passed to the fsspec filesystem (endpoint, credentials, ...); only with a URL.
        Credentials otherwise come from the usual environment and config chain.
    root:
        A path appended to the URL, or, with a filesystem, the path inside it.

    Raises
    ------
    UnknownProtocolError, MissingDependencyError
        The protocol is not served, or its package is not installed.
    StorageOptionError
        ``storage_options`` holds an option the protocol's filesystem does not know (local
        disk, memory, S3 and GCS; see :mod:`.options`).
    """
    if isinstance(url_or_fs, AbstractFileSystem):
        if storage_options:
            raise ValueError(
                "storage_options apply to a URL only; this filesystem is already built"
            )
        cls = backend_class(first_protocol(url_or_fs))
        assert issubclass(cls, FsspecBackend)
        return cls(url_or_fs, root or "")
    protocol = fsspec.core.split_protocol(url_or_fs)[0] or "file"
    cls = backend_class(protocol)
    assert issubclass(cls, FsspecBackend)
    options = dict(storage_options or {})
    check_storage_options(cls, protocol, options, redact_url(url_or_fs))
    return cls.from_url(url_or_fs, options, root)


def open_location(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Backend, str]:
    """The backend of ``url``'s parent folder and the name of the folder inside it.

    A checkpoint is one folder; the saver and the tools work on its parent, where sibling
    checkpoints, staging folders and commit records live.

    Raises
    ------
    ValueError
        ``url`` names no folder under a parent path (``""``, ``"s3://"``, ``"s3://bucket"``).
    """
    parent, _, name = url.rstrip("/").rpartition("/")
    if not name or parent.endswith(":/"):
        raise ValueError(f"checkpoint URL {url!r} must name a folder under a parent path")
    return open_backend(parent or ".", storage_options), name
