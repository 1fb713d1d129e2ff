"""The conformance suite on a local directory, plus local-only guarantees."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Any, ClassVar

import numpy as np
import pytest

from de_store.backends import Backend, local, open_backend
from de_store.backends.local import LocalBackend
from de_store.errors import BackendError
from de_store.testing import StorageLocation
from de_store.testing.backend_suite import BackendTests
from de_store.testing.page_cache import evict, reads_from_disk


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
    """Written through the page cache (where the filesystem refuses ``O_DIRECT``, or
    ``direct_writes`` is off) and out while it is written, by ``sync_file_range``
    (Linux) or by ``fdatasync`` in a helper thread (elsewhere), every 4 KiB here: the
    file is whole."""
    monkeypatch.setattr(LocalBackend, "direct_writes", False)
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


def _aligned(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes at an address aligned for ``read_at``."""
    raw = bytearray(size + local.READ_ALIGNMENT)
    start = -np.frombuffer(raw, np.uint8).ctypes.data % local.READ_ALIGNMENT
    return memoryview(raw)[start : start + size]


_READS = [(0, 1 << 20), (4096, 8192), (3 << 20, 1 << 20)]  # the last one past the end


@pytest.mark.skipif(not local.POSITIONAL_READS, reason="no preadv on this system")
@pytest.mark.parametrize("cached", [True, False], ids=["in_page_cache", "evicted"])
def test_read_at_reads_the_files_bytes_from_the_cache_or_the_disk(
    local_location: StorageLocation, cached: bool
) -> None:
    """A range the page cache holds is read from it; one it does not, straight from the
    disk (O_DIRECT, Linux): the same bytes either way, fewer only at the file's end."""
    backend = local_location.open()
    data = np.random.default_rng(7).integers(0, 256, (3 << 20) + 1234, np.uint8).tobytes()
    backend.write_bytes("f.bin", data)
    if cached:  # written straight to the disk; read once into the page cache
        assert backend.read_bytes("f.bin") == data
    else:
        evict(backend.local_path("f.bin"))
    backend.stats.reset()
    with backend.open_read("f.bin") as f:
        assert isinstance(f, local.LocalReadFile)
        for offset, size in _READS:
            view = _aligned(size)
            n = f.read_at(view, offset)
            assert n == min(size, len(data) - offset)
            assert view[:n] == data[offset : offset + n]
        reads = (f.cached_reads, f.direct_reads)
    if not reads_from_disk(backend.local_path("f.bin")):  # tmpfs: no page cache apart
        assert sum(reads) == 3
    elif cached:
        assert reads == (3, 0)
    else:  # the kernel may hold a range's last page again by the time it is read
        assert sum(reads) == 3 and reads[1] > 0
    assert backend.stats.bytes_read == (1 << 20) + 8192 + 1234


def _refusing_open(real: Any) -> Any:
    def refusing(path: str, flags: int, *args: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return int(real(path, flags, *args))

    return refusing


def _refusing_direct_reads(real: Any, direct_fds: set[int]) -> Any:
    def refusing(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return int(real(fd, buffers, offset, *args))

    return refusing


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this system")
@pytest.mark.parametrize("refused_by", ["open", "read"])
def test_filesystem_refusing_direct_reads_is_read_through_the_page_cache(
    local_location: StorageLocation, monkeypatch: pytest.MonkeyPatch, refused_by: str
) -> None:
    """A filesystem that refuses O_DIRECT, at ``open`` or at each read (``EINVAL``, as
    some FUSE and network filesystems do), has its ranges read through the page cache."""
    backend = local_location.open()
    data = bytes(range(256)) * 8192
    backend.write_bytes("f.bin", data)
    evict(backend.local_path("f.bin"))
    direct_fds: set[int] = set()
    real_open = os.open
    if refused_by == "open":
        monkeypatch.setattr(os, "open", _refusing_open(real_open))
    else:

        def remembering(path: str, flags: int, *args: Any) -> int:
            fd = int(real_open(path, flags, *args))
            if flags & os.O_DIRECT:
                direct_fds.add(fd)
            return fd

        monkeypatch.setattr(os, "open", remembering)
        monkeypatch.setattr(os, "preadv", _refusing_direct_reads(os.preadv, direct_fds))
    with backend.open_read("f.bin") as f:
        assert isinstance(f, local.LocalReadFile)
        for offset in (0, 1 << 20):
            view = _aligned(1 << 20)
            assert f.read_at(view, offset) == 1 << 20
            assert view == data[offset : offset + (1 << 20)]
        assert (f.cached_reads, f.direct_reads) == (2, 0)
    assert len(direct_fds) == (1 if refused_by == "read" else 0)


@pytest.mark.skipif(not local.POSITIONAL_READS, reason="no preadv on this system")
def test_read_at_reads_the_open_file_when_its_name_now_leads_to_another(
    local_location: StorageLocation,
) -> None:
    """The O_DIRECT handle is opened by name at the first read: a file put in the open
    one's place before then is not read, the open one is, through the page cache."""
    backend = local_location.open()
    old, new = b"o" * (2 << 20), b"n" * (2 << 20)
    backend.write_bytes("f.bin", old)
    backend.write_bytes("g.bin", new)
    evict(backend.local_path("f.bin"))
    with backend.open_read("f.bin") as f:
        os.replace(backend.local_path("g.bin"), backend.local_path("f.bin"))
        assert isinstance(f, local.LocalReadFile)
        view = _aligned(1 << 20)
        assert f.read_at(view, 1 << 20) == 1 << 20
        assert view == old[: 1 << 20]
        assert (f.cached_reads, f.direct_reads) == (1, 0)


def _cached_pages(path: str) -> int:
    """How many of the file's pages the page cache holds (each asked for with
    ``RWF_NOWAIT`` through a handle whose read-ahead is off: a miss reads nothing)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        probe, cached = bytearray(1), 0
        for offset in range(0, os.fstat(fd).st_size, 4096):
            with contextlib.suppress(BlockingIOError):  # not cached
                cached += os.preadv(fd, [probe], offset, os.RWF_NOWAIT) > 0
        return cached
    finally:
        os.close(fd)


def _small_direct_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two direct-write buffers of 8 KiB: a file of a few KiB fills, hands out and
    reuses them."""
    monkeypatch.setattr(LocalBackend, "direct_buffer_size", 8192)
    monkeypatch.setattr(LocalBackend, "direct_buffers", 2)


def _write_in_pieces(backend: Backend, path: str, data: bytes, piece: int = 3000) -> None:
    with backend.open_write(path) as f:
        for start in range(0, len(data), piece):
            f.write(memoryview(data)[start : start + piece])


needs_direct_io = pytest.mark.skipif(
    not hasattr(os, "O_DIRECT") or not hasattr(os, "RWF_NOWAIT"), reason="Linux only"
)


@needs_direct_io
@pytest.mark.parametrize("size", [0, 100, 8192, 3 * 8192, 5 * 8192 + 1234])
def test_streamed_write_goes_straight_to_the_disk(
    local_location: StorageLocation, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """Written with O_DIRECT through the file's own buffers, in pieces that straddle
    them: the file holds exactly the bytes written (the last buffer's padding cut off),
    and none of its pages went into the page cache (where the filesystem keeps one apart
    from its files)."""
    _small_direct_buffers(monkeypatch)
    backend = local_location.open()
    data = np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes()
    _write_in_pieces(backend, "f.bin", data)
    path = backend.local_path("f.bin")
    assert path is not None and os.path.getsize(path) == size
    if reads_from_disk(path):
        assert _cached_pages(path) == 0
    assert backend.read_bytes("f.bin") == data
    assert backend.stats.bytes_written == size
    assert backend.list() == ["f.bin"]


def _aligned_copy(data: bytes) -> np.ndarray:
    """``data`` at an address aligned for direct writes."""
    out = np.frombuffer(_aligned(len(data)), np.uint8)
    out[:] = np.frombuffer(data, np.uint8)
    return out


@needs_direct_io
def test_data_handed_over_goes_to_the_disk_from_where_it_is(
    local_location: StorageLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hand_over`` of data the writer will not change: where it starts at an aligned
    address and the file so far ends at an aligned offset, its whole blocks go to the disk
    from the caller's memory (the write is given that memory) and only the partial last
    block is copied; otherwise it is copied as ``write`` copies. The file holds exactly
    the bytes given, in order, either way."""
    _small_direct_buffers(monkeypatch)
    real_pwrite = os.pwrite
    written_from: list[int] = []  # the address of each write's bytes

    def recording_pwrite(fd: int, data: Any, offset: int) -> int:
        written_from.append(np.frombuffer(data, np.uint8).ctypes.data)
        return int(real_pwrite(fd, data, offset))

    monkeypatch.setattr(os, "pwrite", recording_pwrite)
    rng = np.random.default_rng(7)
    head, tail = rng.bytes(4096 * 3), rng.bytes(1000)
    frame = _aligned_copy(rng.bytes(4096 * 5 + 300))  # 5 whole blocks and a partial one
    unaligned_frame = _aligned_copy(rng.bytes(4096 * 2 + 1))[1:]  # starts one byte past a page
    late_frame = _aligned_copy(rng.bytes(4096 * 2))  # handed over where the file is unaligned
    backend = local_location.open()
    with backend.open_write("f.bin") as f:
        f.write(head)
        assert f.hand_over(frame) == frame.nbytes
        f.write(tail)
        f.hand_over(unaligned_frame)
        f.hand_over(late_frame)
    assert backend.read_bytes("f.bin") == (
        head + frame.tobytes() + tail + unaligned_frame.tobytes() + late_frame.tobytes()
    )
    assert written_from.count(frame.ctypes.data) == 1
    others = (unaligned_frame.ctypes.data, late_frame.ctypes.data)
    assert not any(address in others for address in written_from)
    assert backend.stats.bytes_written == len(head) + len(tail) + sum(
        a.nbytes for a in (frame, unaligned_frame, late_frame)
    )


@needs_direct_io
def test_a_file_written_through_the_page_cache_takes_data_handed_over_as_a_write(
    tmp_path: Any,
) -> None:
    """Where direct writes are off, ``hand_over`` writes as ``write`` does, and the file
    offers no alignment to place data at."""
    backend = open_backend(str(tmp_path))
    assert isinstance(backend, LocalBackend)
    backend.direct_writes = False
    frame = _aligned_copy(bytes(range(256)) * 64)
    with backend.open_write("f.bin") as f:
        assert getattr(f, "direct_alignment", None) is None
        f.write(b"x" * 10)
        f.hand_over(frame)
    assert backend.read_bytes("f.bin") == b"x" * 10 + frame.tobytes()


def _flags(fd: int) -> int:
    import fcntl

    return int(fcntl.fcntl(fd, fcntl.F_GETFL))


@needs_direct_io
@pytest.mark.parametrize("refused_by", ["open", "write"])
def test_filesystem_refusing_direct_writes_is_written_through_the_page_cache(
    local_location: StorageLocation, monkeypatch: pytest.MonkeyPatch, refused_by: str
) -> None:
    """A filesystem that refuses O_DIRECT when it is turned on, or at a write (``EINVAL``,
    as some FUSE and network filesystems do), has the file written through the page
    cache: that write again and every one after it, the file whole."""
    import fcntl

    _small_direct_buffers(monkeypatch)
    real_fcntl, real_pwrite = fcntl.fcntl, os.pwrite
    writes: list[bool] = []  # whether each write was asked of a direct descriptor
    if refused_by == "open":

        def refusing_fcntl(fd: int, cmd: int, arg: int = 0) -> int:
            if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return int(real_fcntl(fd, cmd, arg))

        monkeypatch.setattr(fcntl, "fcntl", refusing_fcntl)
    else:

        def refusing_pwrite(fd: int, data: Any, offset: int) -> int:
            writes.append(bool(_flags(fd) & os.O_DIRECT))
            if writes[-1]:
                raise OSError(errno.EINVAL, "Invalid argument")
            return int(real_pwrite(fd, data, offset))

        monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    backend = local_location.open()
    data = bytes(range(256)) * 200
    _write_in_pieces(backend, "f.bin", data)
    assert backend.read_bytes("f.bin") == data
    if refused_by == "write":  # the first write refused, then the page cache: 7 buffers
        assert writes == [True] + [False] * 7
    path = backend.local_path("f.bin")
    assert path is not None
    if reads_from_disk(path):
        assert _cached_pages(path) > 0


@needs_direct_io
@pytest.mark.parametrize("size", [4000, 5 * 8192], ids=["one_buffer", "several_buffers"])
def test_failed_direct_write_leaves_nothing(
    local_location: StorageLocation, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """A disk error in a direct write (here the disk full at the file's second buffer, or
    its only one) fails ``open_write`` with an error naming the file, from the write that
    follows or from the final sync, and leaves no file, final or temporary."""
    _small_direct_buffers(monkeypatch)
    backend = local_location.open()
    backend.write_bytes("kept.bin", b"k")
    real_pwrite = os.pwrite
    calls: list[int] = []

    def filling_pwrite(fd: int, data: Any, offset: int) -> int:
        calls.append(offset)
        if len(calls) == (1 if size < 8192 else 2):
            raise OSError(errno.ENOSPC, "No space left on device")
        return int(real_pwrite(fd, data, offset))

    monkeypatch.setattr(os, "pwrite", filling_pwrite)
    with pytest.raises(BackendError, match=r"cannot write .*f\.bin: OSError: .*No space left"):
        _write_in_pieces(backend, "f.bin", bytes(size))
    root = backend.local_path("")
    assert root is not None and os.listdir(root) == ["kept.bin"]
