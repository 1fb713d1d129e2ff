"""Protocol resolution: which backend serves a URL, and the errors when none can."""

from __future__ import annotations

import importlib.util

import fsspec
import pytest
from fsspec.implementations.dirfs import DirFileSystem

from de_store.backends import BackendSpec, backend_class, open_backend, register_backend
from de_store.backends.fsspec_generic import FsspecBackend
from de_store.backends.registry import registry
from de_store.errors import BackendError, MissingDependencyError, UnknownProtocolError


@pytest.mark.parametrize(
    ("protocol", "class_name"),
    [
        ("file", "LocalBackend"),
        ("memory", "MemoryBackend"),
        ("s3", "S3Backend"),
        ("gs", "GCSBackend"),
        ("gcs", "GCSBackend"),
        ("zip", "FsspecBackend"),
    ],
)
def test_protocol_resolves_to_its_backend(protocol: str, class_name: str) -> None:
    assert backend_class(protocol).__name__ == class_name


def test_unknown_protocol_names_it() -> None:
    with pytest.raises(UnknownProtocolError, match="'nosuchproto'") as info:
        open_backend("nosuchproto://bucket/path")
    assert isinstance(info.value, ValueError)


def test_missing_package_names_protocol_and_package() -> None:
    spec = BackendSpec(
        "de_store.backends.fsspec_generic.FsspecBackend", "de-store-absent", "de_store_absent"
    )
    register_backend("absentproto", spec)
    try:
        with pytest.raises(
            MissingDependencyError, match=r"'absentproto'.*pip install de-store-absent"
        ):
            open_backend("absentproto://bucket/x")
    finally:
        del registry["absentproto"]


@pytest.mark.skipif(importlib.util.find_spec("adlfs") is not None, reason="adlfs installed")
def test_azure_without_adlfs_says_to_install_it() -> None:
    with pytest.raises(MissingDependencyError, match=r"'abfs'.*adlfs") as info:
        open_backend("abfs://container/path")
    assert isinstance(info.value, ImportError)


def test_register_refuses_to_clobber_silently() -> None:
    with pytest.raises(ValueError, match="'s3' is registered already"):
        register_backend("s3", BackendSpec("x.Y"))


def test_other_fsspec_protocol_uses_generic_backend() -> None:
    fs = fsspec.filesystem("memory")
    backend = open_backend(DirFileSystem("/generic-test", fs))
    assert type(backend) is FsspecBackend
    backend.write_bytes("a/b.bin", b"generic")
    assert backend.list() == ["a/b.bin"]
    assert fs.cat_file("/generic-test/a/b.bin") == b"generic"
    backend.delete("", recursive=True)


def test_storage_options_with_built_filesystem_are_refused() -> None:
    with pytest.raises(ValueError, match="already built"):
        open_backend(fsspec.filesystem("memory"), {"key": "x"})


def test_credentials_in_url_never_appear_in_messages() -> None:
    backend = open_backend("memory://user:hunter2@creds-test/x")
    assert "hunter2" not in backend.url
    with pytest.raises(BackendError) as info:
        backend.read_bytes("missing.bin")
    assert "hunter2" not in str(info.value)
