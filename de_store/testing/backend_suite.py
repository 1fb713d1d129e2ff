"""The conformance suite of the :class:`~de_store.backends.Backend` contract.

A backend's test file subclasses :class:`BackendTests` and defines the ``location``
fixture (a :class:`~de_store.testing.StorageLocation` of an empty place in the store);
pytest then runs every test here against that backend::

    from de_store.testing import StorageLocation
    from de_store.testing.backend_suite import BackendTests

    class TestMyBackend(BackendTests):
        atomic_rename = False  # what the backend declares

        @pytest.fixture
        def location(self, tmp_path):
            return StorageLocation("mine", f"mine://{tmp_path}")

de_store's own backends (local, memory, S3 on a moto server, GCS on the emulator) run it
the same way. A backend's quirk is a marked test in that backend's own file, never an
``if`` here. This module needs pytest (a test dependency); ``import de_store`` does not.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import pytest

from de_store.backends import Backend, Capabilities, open_backend
from de_store.errors import AlreadyExistsError, StorageNotFoundError
from de_store.testing import StorageLocation

MIB = 1 << 20


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` deterministic pseudo-random bytes."""
    return random.Random(seed).randbytes(n)


class BackendTests:
    """Behaviour every backend must show. Subclasses define the ``location`` fixture."""

    #: Whether the backend declares atomic rename.
    atomic_rename: ClassVar[bool] = False
    #: Extra storage options the backend's filesystem accepts (pass-through check).
    passthrough_options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def location(self) -> StorageLocation:
        raise NotImplementedError("a backend test class must define the location fixture")

    @pytest.fixture
    def backend(self, location: StorageLocation) -> Backend:
        return location.open()

    # --- streaming, whole and ranged reads -----------------------------------------------
    def test_streamed_write_read_roundtrip(self, backend: Backend) -> None:
        data = payload(6 * MIB + 123)  # more than one S3 multipart block
        with backend.open_write("shards/big.bin") as f:
            for start in range(0, len(data), 256 * 1024):
                f.write(data[start : start + 256 * 1024])
        chunks = list(backend.iter_chunks("shards/big.bin", chunk_size=MIB))
        assert [len(c) for c in chunks[:-1]] == [MIB] * 6
        assert b"".join(chunks) == data
        assert backend.read_bytes("shards/big.bin") == data

    def test_open_read_is_seekable(self, backend: Backend) -> None:
        data = payload(100_000)
        backend.write_bytes("f.bin", data)
        with backend.open_read("f.bin") as f:
            f.seek(90_000)
            assert f.read(20) == data[90_000:90_020]
            assert f.tell() == 90_020
            f.seek(0)
            assert f.read() == data

    def test_open_read_serves_any_seek_pattern(self, backend: Backend) -> None:
        """Sequential reads, short skips forwards, seeks anywhere, from the end and past
        it: a streamed reader's every path (one GET per run on S3 and GCS)."""
        data = payload(3 * MIB + 17)
        backend.write_bytes("r.bin", data)
        rng = random.Random(5)
        with backend.open_read("r.bin") as f:
            assert f.read(10) == data[:10]
            assert f.read(MIB) == data[10 : 10 + MIB]
            f.seek(100, 1)
            assert f.read(5) == data[MIB + 110 : MIB + 115]
            for _ in range(20):
                start, size = rng.randrange(len(data)), rng.randrange(2 * MIB)
                f.seek(start)
                assert f.read(size) == data[start : start + size]
            f.seek(-7, 2)
            assert f.read() == data[-7:]
            assert f.read(3) == b""

    def test_read_range(self, backend: Backend) -> None:
        data = payload(10_000)
        backend.write_bytes("f.bin", data)
        assert backend.read_range("f.bin", 0, 10) == data[:10]
        assert backend.read_range("f.bin", 4_321, 9_999) == data[4_321:9_999]
        assert backend.read_range("f.bin", 9_990, 10_000) == data[9_990:]
        assert backend.read_range("f.bin", 500, 500) == b""

    def test_overwrite_replaces_content(self, backend: Backend) -> None:
        backend.write_bytes("f.bin", b"old content, longer")
        backend.write_bytes("f.bin", b"new")
        assert backend.read_bytes("f.bin") == b"new"

    # --- listing, exists, size, delete --------------------------------------------------
    def _populate(self, backend: Backend) -> None:
        for path in ["z.bin", "d/b.bin", "d/e/c.bin", "dd/x.bin", "a.bin"]:
            backend.write_bytes(path, path.encode())

    def test_list_sorted_recursive_and_by_prefix(self, backend: Backend) -> None:
        self._populate(backend)
        assert backend.list() == ["a.bin", "d/b.bin", "d/e/c.bin", "dd/x.bin", "z.bin"]
        assert backend.list("d") == ["d/b.bin", "d/e/c.bin"]
        assert backend.list("d/e") == ["d/e/c.bin"]
        assert backend.list("missing") == []

    def test_list_empty_location(self, backend: Backend) -> None:
        assert backend.list() == []

    def test_exists(self, backend: Backend) -> None:
        self._populate(backend)
        assert backend.exists("d/b.bin")
        assert backend.exists("d")
        assert not backend.exists("d/missing.bin")
        assert not backend.exists("missing")

    def test_size(self, backend: Backend) -> None:
        backend.write_bytes("f.bin", payload(12_345))
        backend.write_bytes("empty.bin", b"")
        assert backend.size("f.bin") == 12_345
        assert backend.size("empty.bin") == 0

    def test_delete_file_and_missing(self, backend: Backend) -> None:
        self._populate(backend)
        backend.delete("a.bin")
        backend.delete("never-existed.bin")
        assert not backend.exists("a.bin")
        assert backend.list() == ["d/b.bin", "d/e/c.bin", "dd/x.bin", "z.bin"]

    def test_delete_recursive(self, backend: Backend) -> None:
        self._populate(backend)
        backend.delete("d", recursive=True)
        assert backend.list() == ["a.bin", "dd/x.bin", "z.bin"]
        assert not backend.exists("d")

    # --- publish and write_once ---------------------------------------------------------
    def test_publish_file(self, backend: Backend) -> None:
        backend.write_bytes("tmp/f.bin", b"content")
        backend.publish("tmp/f.bin", "final/f.bin")
        assert backend.read_bytes("final/f.bin") == b"content"
        assert not backend.exists("tmp/f.bin")

    def test_publish_directory(self, backend: Backend) -> None:
        for name in ["a.bin", "sub/b.bin"]:
            backend.write_bytes(f"staging/{name}", name.encode())
        backend.publish("staging", "ckpt-1")
        assert backend.list() == ["ckpt-1/a.bin", "ckpt-1/sub/b.bin"]
        assert backend.read_bytes("ckpt-1/sub/b.bin") == b"sub/b.bin"

    def test_publish_missing_source_raises_not_found(self, backend: Backend) -> None:
        with pytest.raises(StorageNotFoundError, match="nothing-here"):
            backend.publish("nothing-here", "dst")
        assert not backend.exists("dst")

    def test_write_once_second_write_raises(self, backend: Backend) -> None:
        backend.write_once("COMMITTED", b"first")
        with pytest.raises(AlreadyExistsError, match="COMMITTED"):
            backend.write_once("COMMITTED", b"second")
        assert backend.read_bytes("COMMITTED") == b"first"

    def test_concurrent_write_once_has_exactly_one_winner(self, backend: Backend) -> None:
        winners = race_write_once(backend, "COMMITTED")
        assert len(winners) == 1
        assert backend.read_bytes("COMMITTED") == f"writer {winners[0]}".encode()

    # --- failures -----------------------------------------------------------------------
    def test_failed_write_leaves_nothing(self, backend: Backend) -> None:
        with pytest.raises(RuntimeError, match="boom"), backend.open_write("d/f.bin") as f:
            f.write(payload(MIB))
            raise RuntimeError("boom")
        assert not backend.exists("d/f.bin")
        assert backend.list() == []

    def test_failed_overwrite_keeps_old_content(self, backend: Backend) -> None:
        backend.write_bytes("f.bin", b"old")
        with pytest.raises(RuntimeError, match="boom"), backend.open_write("f.bin") as f:
            f.write(b"new, partial")
            raise RuntimeError("boom")
        assert backend.read_bytes("f.bin") == b"old"
        assert backend.list() == ["f.bin"]

    @pytest.mark.parametrize(
        "op",
        [
            lambda b: b.read_bytes("no/such.bin"),
            lambda b: b.read_range("no/such.bin", 0, 4),
            lambda b: b.size("no/such.bin"),
            lambda b: b.open_read("no/such.bin").__enter__(),
        ],
        ids=["read_bytes", "read_range", "size", "open_read"],
    )
    def test_missing_raises_not_found_naming_path(self, backend: Backend, op: Any) -> None:
        with pytest.raises(StorageNotFoundError, match=r"no/such\.bin") as info:
            op(backend)
        assert isinstance(info.value, FileNotFoundError)
        assert backend.url.rstrip("/") in str(info.value)

    def test_path_escaping_root_is_rejected(self, backend: Backend) -> None:
        with pytest.raises(ValueError, match=r"\.\."):
            backend.write_bytes("../outside.bin", b"x")

    # --- accounting, options, capabilities ---------------------------------------------
    def test_stats_count_bytes(self, backend: Backend) -> None:
        data = payload(300_000)
        with backend.open_write("f.bin") as f:
            f.write(data[:100_000])
            f.write(memoryview(data)[100_000:])
        backend.write_once("marker", b"12345")
        assert backend.stats.bytes_written == 300_005
        assert backend.stats.bytes_read == 0
        assert backend.read_bytes("f.bin") == data
        assert backend.read_range("f.bin", 10, 1_010) == data[10:1_010]
        with backend.open_read("f.bin") as f:
            f.read(7)
        assert backend.stats.bytes_read == 300_000 + 1_000 + 7
        backend.stats.reset()
        assert (backend.stats.bytes_read, backend.stats.bytes_written) == (0, 0)

    def test_storage_options_pass_through(self, location: StorageLocation) -> None:
        options = {**location.storage_options, **self.passthrough_options}
        backend = open_backend(location.url, options)
        for key, value in options.items():
            assert backend.fs.storage_options[key] == value  # type: ignore[attr-defined]
        backend.write_bytes("f.bin", b"via options")
        assert location.open().read_bytes("f.bin") == b"via options"

    def test_accepts_built_filesystem(self, backend: Backend) -> None:
        fs, root = backend.fs, backend.root  # type: ignore[attr-defined]
        other = open_backend(fs, root=root)
        other.write_bytes("x/f.bin", b"through the filesystem")
        assert backend.read_bytes("x/f.bin") == b"through the filesystem"
        assert other.list() == ["x/f.bin"]
        assert type(other) is type(backend)

    def test_root_sub_path(self, location: StorageLocation) -> None:
        location.open(root="sub/dir").write_bytes("f.bin", b"x")
        assert location.open().list() == ["sub/dir/f.bin"]

    def test_capabilities_declared(self, backend: Backend) -> None:
        assert isinstance(backend.capabilities, Capabilities)
        assert backend.capabilities.supports_atomic_rename is self.atomic_rename


def race_write_once(backend: Backend, path: str, writers: int = 8) -> list[int]:
    """``writers`` threads ``write_once(path, b"writer <i>")`` at once; the i that succeeded."""

    def attempt(i: int) -> int | None:
        try:
            backend.write_once(path, f"writer {i}".encode())
        except AlreadyExistsError:
            return None
        return i

    with ThreadPoolExecutor(writers) as pool:
        return [i for i in pool.map(attempt, range(writers)) if i is not None]
