"""The conformance suite on S3, served by a real moto server, plus S3-only guarantees."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from conformance import BackendConformance

from de_store.backends import open_backend
from de_store.backends.s3 import S3Backend
from de_store.errors import BackendError
from de_store.testing import StorageLocation


class TestS3Backend(BackendConformance):
    passthrough_options: ClassVar[dict[str, Any]] = {"default_block_size": 6 * 1024 * 1024}

    @pytest.fixture
    def location(self, s3_location: StorageLocation) -> StorageLocation:
        return s3_location


def test_create_exclusive_put_is_enforced_by_the_server(s3_location: StorageLocation) -> None:
    backend = s3_location.open()
    assert isinstance(backend, S3Backend)
    backend.write_once("COMMITTED", b"first")
    # Skip the client-side existence check: the If-None-Match precondition alone refuses.
    with pytest.raises(FileExistsError):
        backend.fs.pipe_file(backend._full("COMMITTED"), b"racer", mode="create")
    assert backend.read_bytes("COMMITTED") == b"first"


def test_options_reach_s3fs_and_errors_name_the_url_not_the_secret(
    s3_location: StorageLocation,
) -> None:
    options = {**s3_location.storage_options, "secret": "not-the-secret-123"}
    options["key"] = "unknown-key"
    backend = open_backend(s3_location.url, {**options, "skip_instance_cache": True})
    backend.write_bytes("f.bin", b"x")  # moto accepts any credentials; prove the options reach it
    assert backend.fs.storage_options["key"] == "unknown-key"  # type: ignore[attr-defined]
    missing_bucket = open_backend("s3://no-such-bucket/x", options)
    with pytest.raises(BackendError) as info:
        missing_bucket.write_bytes("f.bin", b"x")  # a write never creates a bucket
    assert "not-the-secret-123" not in str(info.value)
    assert "s3://no-such-bucket/x/f.bin" in str(info.value)
