"""The conformance suite on S3, served by a real moto server, plus S3-only guarantees."""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest

from de_store.backends import open_backend
from de_store.backends.s3 import S3Backend
from de_store.errors import BackendError
from de_store.testing import StorageLocation
from de_store.testing.backend_suite import BackendTests

MIB = 1 << 20


class TestS3Backend(BackendTests):
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


@pytest.fixture
def small_parts(s3_location: StorageLocation, monkeypatch: pytest.MonkeyPatch) -> S3Backend:
    """An S3 backend uploading 5 MiB parts, two at a time, holding two (files under 15 MiB
    go as one PUT)."""
    monkeypatch.setattr(S3Backend, "upload_part_size", 5 << 20)
    monkeypatch.setattr(S3Backend, "upload_concurrency", 2)
    monkeypatch.setattr(S3Backend, "upload_whole_parts", 2)
    backend = s3_location.open()
    assert isinstance(backend, S3Backend)
    return backend


def _pending_uploads(backend: S3Backend) -> list[Any]:
    bucket = backend.root.split("/")[0]
    found = backend.fs.call_s3("list_multipart_uploads", Bucket=bucket)  # type: ignore[attr-defined]
    return list(found.get("Uploads", []))


def test_streamed_write_uploads_parts_concurrently(small_parts: S3Backend) -> None:
    data = random.Random(1).randbytes(17 * MIB + 5)  # three full parts and a short one
    with small_parts.open_write("big.bin") as f:
        for start in range(0, len(data), 3 * MIB):
            f.write(memoryview(data)[start : start + 3 * MIB])
        assert not small_parts.exists("big.bin")  # invisible until the upload completes
    assert small_parts.read_bytes("big.bin") == data
    assert small_parts.stats.bytes_written == len(data)
    assert _pending_uploads(small_parts) == []


def test_failed_multipart_write_is_aborted_and_leaves_nothing(
    small_parts: S3Backend, s3_requests: list[tuple[str, str]]
) -> None:
    with pytest.raises(RuntimeError, match="boom"), small_parts.open_write("big.bin") as f:
        f.write(random.Random(2).randbytes(16 * MIB))  # three parts: the upload started
        assert "create_multipart_upload" in [m for m, _ in s3_requests]
        raise RuntimeError("boom")
    assert not small_parts.exists("big.bin")
    assert small_parts.list() == []
    assert _pending_uploads(small_parts) == []


def test_failed_overwrite_with_parts_keeps_old_object(small_parts: S3Backend) -> None:
    small_parts.write_bytes("f.bin", b"old")
    with pytest.raises(RuntimeError, match="boom"), small_parts.open_write("f.bin") as f:
        f.write(random.Random(3).randbytes(16 * MIB))
        raise RuntimeError("boom")
    assert small_parts.read_bytes("f.bin") == b"old"


def test_object_under_whole_parts_plus_one_goes_as_one_put(
    small_parts: S3Backend, s3_requests: list[tuple[str, str]]
) -> None:
    """Two full parts held: an object that ends under three parts is one PUT; one byte
    more starts a multipart upload with the held parts."""
    data = random.Random(9).randbytes(15 * MIB - 1)
    s3_requests.clear()
    with small_parts.open_write("whole.bin") as f:
        for start in range(0, len(data), 3 * MIB):
            f.write(memoryview(data)[start : start + 3 * MIB])
        assert s3_requests == []  # nothing sent while the object may go whole
    assert s3_requests == [("put_object", "root/whole.bin")]
    assert small_parts.read_bytes("whole.bin") == data
    s3_requests.clear()
    with small_parts.open_write("parts.bin") as f:
        f.write(data + b"x")
    methods = [m for m, _ in s3_requests]
    assert methods[0] == "create_multipart_upload" and methods[-1] == "complete_multipart_upload"
    assert methods.count("upload_part") == 3
    assert small_parts.read_bytes("parts.bin") == data + b"x"
    assert small_parts.stats.bytes_written == 2 * len(data) + 1


def test_without_whole_parts_every_full_part_is_sent_while_writing(
    small_parts: S3Backend, s3_requests: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(S3Backend, "upload_whole_parts", 0)
    data = random.Random(11).randbytes(5 * MIB + 3)
    s3_requests.clear()
    with small_parts.open_write("parts.bin") as f:
        f.write(data)
        assert [m for m, _ in s3_requests][:1] == ["create_multipart_upload"]
    assert [m for m, _ in s3_requests].count("upload_part") == 2
    assert small_parts.read_bytes("parts.bin") == data


def test_failed_write_under_the_put_size_sends_nothing(
    small_parts: S3Backend, s3_requests: list[tuple[str, str]]
) -> None:
    small_parts.write_bytes("f.bin", b"old")
    s3_requests.clear()
    with pytest.raises(RuntimeError, match="boom"), small_parts.open_write("f.bin") as f:
        f.write(random.Random(10).randbytes(12 * MIB))  # two full parts held
        raise RuntimeError("boom")
    assert s3_requests == []
    assert small_parts.read_bytes("f.bin") == b"old"
    assert _pending_uploads(small_parts) == []


def test_streamed_write_to_missing_bucket_names_the_object(s3_location: StorageLocation) -> None:
    backend = open_backend("s3://no-such-bucket/x", s3_location.storage_options)
    missing = r"s3://no-such-bucket/x/big\.bin"
    with pytest.raises(BackendError, match=missing), backend.open_write("big.bin") as f:
        f.write(bytes(20 * MIB))


@pytest.fixture
def s3_requests(
    s3_location: StorageLocation, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, str]]:
    """Every request s3fs makes from here on, as ``(method, key or prefix)``.

    Patched on the class, never on an fs instance: fsspec caches instances, and undoing a
    patch on one leaves an instance attribute that hides later class patches."""
    import s3fs

    made: list[tuple[str, str]] = []
    call_s3 = s3fs.S3FileSystem._call_s3

    async def counting(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        made.append((method, str(kwargs.get("Key", kwargs.get("Prefix", "")))))
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    fs = s3_location.open().fs  # type: ignore[attr-defined]
    assert type(fs) is s3fs.S3FileSystem and "_call_s3" not in vars(fs), (type(fs), vars(fs))
    return made


def test_sequential_streamed_read_is_one_get(
    s3_location: StorageLocation, s3_requests: list[tuple[str, str]]
) -> None:
    backend = s3_location.open()
    assert isinstance(backend, S3Backend)
    data = random.Random(6).randbytes(5 * MIB)
    backend.write_bytes("r.bin", data)
    s3_requests.clear()
    with backend.open_read("r.bin") as f:
        chunks = [f.read(MIB // 3) for _ in range(16)]
    assert b"".join(chunks) == data
    assert [m for m, _ in s3_requests].count("get_object") == 1


def test_streamed_read_goes_on_after_its_connection_drops(s3_location: StorageLocation) -> None:
    backend = s3_location.open()
    data = random.Random(7).randbytes(2 * MIB)
    backend.write_bytes("r.bin", data)
    with backend.open_read("r.bin") as f:
        assert f.read(MIB) == data[:MIB]
        f._raw._body.close()  # type: ignore[attr-defined]  # as a server closing an idle GET
        assert f.read(MIB) == data[MIB:]


def test_size_and_write_once_ask_one_head_and_list_asks_once(
    s3_location: StorageLocation, s3_requests: list[tuple[str, str]]
) -> None:
    backend = s3_location.open()
    backend.write_bytes("ckpt/a.bin", b"abc")
    backend.write_bytes("ckpt-10/b.bin", b"x")
    backend.write_bytes("ckpt", b"a file beside the folder")
    s3_requests.clear()
    assert backend.size("ckpt/a.bin") == 3
    assert s3_requests == [("head_object", "root/ckpt/a.bin")]
    s3_requests.clear()
    backend.write_once("ckpt/COMMIT", b"1")
    assert s3_requests == [("head_object", "root/ckpt/COMMIT"), ("put_object", "root/ckpt/COMMIT")]
    s3_requests.clear()
    assert backend.list("ckpt") == ["ckpt/COMMIT", "ckpt/a.bin"]
    assert s3_requests == [("list_objects_v2", "root/ckpt/")]
    s3_requests.clear()
    assert backend.list("ckpt/a.bin") == ["ckpt/a.bin"]  # a file lists itself
    assert backend.list("empty") == []
    assert s3_requests == [
        ("list_objects_v2", "root/ckpt/a.bin/"), ("head_object", "root/ckpt/a.bin"),
        ("list_objects_v2", "root/empty/"), ("head_object", "root/empty"),
    ]  # fmt: skip
    with pytest.raises(FileNotFoundError):
        backend.size("ckpt/missing.bin")


def test_restore_asks_each_shard_file_once_in_the_plan_and_once_to_read(
    s3_location: StorageLocation, s3_requests: list[tuple[str, str]]
) -> None:
    """The checkpoint's folder is listed once, its commit record and manifest read by one
    GET each; each shard file is sized by one HEAD when the plan checks it and one when it
    is opened, then read by two GETs (its footer, then its header and parts in one
    stream); nothing lists a shard's path."""
    import numpy as np
    import tensorflow as tf

    import de_store as ds

    url, options = f"{s3_location.url}/ckpt-1", s3_location.storage_options
    keys = np.arange(1000, dtype=np.int64)
    values = np.random.default_rng(8).standard_normal((1000, 4)).astype(np.float32)
    saved = ds.Variable("s3_requests_emb", dim=4)
    saved.upsert(tf.constant(keys), tf.constant(values))
    ds.save([saved], url, storage_options=options, blocking=True)
    files = s3_location.open().list("ckpt-1")
    shard_keys = [f"root/{path}" for path in files if path.endswith(".parquet")]
    assert len(shard_keys) == 1
    restored = ds.Variable("s3_requests_emb", dim=4)
    s3_requests.clear()
    ds.restore([restored], url, storage_options=options)
    assert [r for r in s3_requests if r[0] == "list_objects_v2"] == [
        ("list_objects_v2", "root/ckpt-1/")
    ]
    for name in ("COMMIT-000001", "manifest-000001.json"):  # read whole: one GET each
        assert [m for m, k in s3_requests if k == f"root/ckpt-1/{name}"] == ["get_object"]
    for key in shard_keys:
        assert [m for m, k in s3_requests if k == key] == [
            "head_object", "head_object", "get_object", "get_object"
        ]  # fmt: skip
    np.testing.assert_array_equal(restored.lookup(tf.constant(keys)).numpy(), values)
