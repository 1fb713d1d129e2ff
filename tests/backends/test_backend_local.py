"""The conformance suite on a local directory, plus local-only guarantees."""

from __future__ import annotations

import os
import stat
from typing import Any, ClassVar

import pytest

from de_store.backends import Backend, local, open_backend
from de_store.backends.local import LocalBackend
from de_store.errors import BackendError
from de_store.testing import StorageLocation
from de_store.testing.backend_suite import BackendTests


class TestLocalBackend(BackendTests):
    atomic_rename = True
    passthrough_options: ClassVar[dict[str, Any]] = {"auto_mkdir": True}

    @pytest.fixture
    def location(self, local_location: StorageLocation) -> StorageLocation:
        return local_location


def test_plain_path_and_file_url_open_the_same_directory(tmp_path: os.PathLike[str]) -> None:
    plain = StorageLocation("local", str(tmp_path)).open()
    url = StorageLocation("local", f"file://{tmp_path}").open()
    assert isinstance(plain, LocalBackend) and isinstance(url, LocalBackend)
    plain.write_bytes("f.bin", b"x")
    assert url.read_bytes("f.bin") == b"x"
    assert plain.local_path("f.bin") == os.path.join(str(tmp_path), "f.bin")


def test_written_file_gets_normal_permissions(local_location: StorageLocation) -> None:
    backend = local_location.open()
    backend.write_bytes("f.bin", b"x")
    mode = stat.S_IMODE(os.stat(backend.local_path("f.bin") or "").st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


def test_failed_write_leaves_no_temporary_file(local_location: StorageLocation) -> None:
    backend = local_location.open()
    backend.write_bytes("d/keep.bin", b"x")
    with pytest.raises(RuntimeError), backend.open_write("d/f.bin") as f:
        f.write(b"partial")
        raise RuntimeError
    assert os.listdir(os.path.dirname(backend.local_path("d/keep.bin") or "")) == ["keep.bin"]


def test_permission_denied_is_a_backend_error_naming_the_path() -> None:
    # sysfs refuses new files even to root, so this runs as any user
    backend: Backend = open_backend("/sys/kernel")
    with pytest.raises(BackendError, match=r"de_store_test/g\.bin.*permission denied"):
        backend.write_bytes("de_store_test/g.bin", b"y")


@pytest.mark.parametrize("writeback", ["sync_file_range", "fdatasync"])
def test_streamed_write_flushed_in_the_background_is_complete(
    local_location: StorageLocation, monkeypatch: pytest.MonkeyPatch, writeback: str
) -> None:
    """Written out while it is written, by ``sync_file_range`` (Linux) or by
    ``fdatasync`` in a helper thread (elsewhere), every 4 KiB here: the file is whole."""
    started: list[tuple[int, int]] = []
    if writeback == "fdatasync":
        monkeypatch.setattr(local, "_WRITEBACK", None)
    elif local._WRITEBACK is None:
        pytest.skip("no sync_file_range here")
    else:
        real = local._WRITEBACK

        def write_out(fd: int, start: int, size: int, flags: int) -> int:
            started.append((start, size))
            return int(real(fd, start, size, flags))

        monkeypatch.setattr(local, "_WRITEBACK", write_out)
    monkeypatch.setattr(LocalBackend, "sync_every", 4096)
    monkeypatch.setattr(LocalBackend, "writeback_every", 4096)
    backend = local_location.open()
    data = bytes(range(256)) * 400
    with backend.open_write("f.bin") as f:
        for start in range(0, len(data), 1000):
            f.write(data[start : start + 1000])
    assert backend.read_bytes("f.bin") == data
    if writeback == "sync_file_range":  # each range where the one before ended, 5 writes long
        assert started == [(start, 5000) for start in range(0, len(data) - 4999, 5000)]
    with pytest.raises(RuntimeError, match="boom"), backend.open_write("g.bin") as f:
        f.write(data)
        raise RuntimeError("boom")
    assert backend.list() == ["f.bin"]
