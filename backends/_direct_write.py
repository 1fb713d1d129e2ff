"""Files written straight from memory to the disk (``O_DIRECT``, Linux), without the page
cache: what :class:`~de_store.backends.local.LocalBackend` writes a file through where the
filesystem takes it."""

from __future__ import annotations

import errno
import io
import mmap
import os
import queue
import threading
from typing import Any

import numpy as np

#: What :class:`DirectFile` asks of its buffers and of the offsets it writes them at: the
#: page size, which ``O_DIRECT`` accepts on Linux's filesystems (a device's logical block,
#: the least it asks, is at most that).
WRITE_ALIGNMENT = 4096


class DirectFile(io.RawIOBase):
    """A file being written straight from memory to the disk (``O_DIRECT``), without the
    page cache.

    Written through the page cache, every byte is first copied into pages the kernel
    takes for the cache: CPU time, and on a virtual machine whose host takes free memory
    back, pages the host must hand out again first, which cost more than the disk's time
    for them (``docs/benchmarks.md``, *The cost curve*). Here the bytes are copied into a
    few page-aligned buffers of the file's own, reused from one to the next, and a helper
    thread hands each full buffer to the disk while the writer fills the next. The last
    buffer is written padded to :data:`WRITE_ALIGNMENT` and the file cut back to its
    length before the final fsync.

    Data the writer hands over (:meth:`hand_over`: it does not change it afterwards) that
    starts in memory at an address of :data:`WRITE_ALIGNMENT` and in the file where the
    buffers so far end at one goes to the disk from where it is, its whole blocks of that
    alignment without a copy (the compressed frames of a Parquet page, placed so by its
    writer); only its last, partial block is copied.

    Where the filesystem refuses a direct write (``EINVAL``, as some FUSE and network
    filesystems do), the descriptor drops ``O_DIRECT`` and that write and the rest go
    through the page cache. An error of the helper thread is raised by the next
    :meth:`write` or by :meth:`sync`.
    """

    def __init__(self, fd: int, buffer_size: int, buffers: int) -> None:
        super().__init__()
        if buffer_size <= 0 or buffer_size % WRITE_ALIGNMENT or buffers < 1:
            raise ValueError(
                f"LocalBackend.direct_buffers must be at least 1 and direct_buffer_size a "
                f"positive multiple of {WRITE_ALIGNMENT} bytes, got {buffers} buffers of "
                f"{buffer_size} bytes"
            )
        self._fd = fd
        self._buffer_size = buffer_size
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(buffers):
            self._free.put(np.frombuffer(mmap.mmap(-1, buffer_size), np.uint8))
        # (bytes, length, file offset, whether one of the file's own buffers)
        self._jobs: queue.SimpleQueue[tuple[np.ndarray, int, int, bool] | None] = (
            queue.SimpleQueue()
        )
        # Places for data handed over and not yet written: as many as own buffers.
        self._handed = threading.Semaphore(buffers)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._current: np.ndarray | None = None
        self._filled = 0  # bytes in the current buffer
        self._offset = 0  # where in the file the current buffer goes
        #: False once the filesystem refused a direct write.
        self.direct = True

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._raise_error()
        source = np.frombuffer(data, np.uint8)
        done = 0
        while done < len(source):
            if self._current is None:
                self._current = self._free.get()  # waits for the disk to take one
                self._raise_error()
            n = min(self._buffer_size - self._filled, len(source) - done)
            self._current[self._filled : self._filled + n] = source[done : done + n]
            self._filled += n
            done += n
            if self._filled == self._buffer_size:
                self._hand_out(self._buffer_size)
        return done

    @property
    def direct_alignment(self) -> int | None:
        """The alignment :meth:`hand_over` writes data from without a copy (None once the
        filesystem refused a direct write)."""
        return WRITE_ALIGNMENT if self.direct else None

    def hand_over(self, data: Any) -> int:
        """Write ``data``, which the caller does not change afterwards: from where it is
        when it and the file's end are aligned (see the class's docstring), else copied
        as :meth:`write` does. The file keeps a reference to it until it is written."""
        self._raise_error()
        source = np.frombuffer(data, np.uint8)
        whole = len(source) - len(source) % WRITE_ALIGNMENT
        aligned = not (self._filled % WRITE_ALIGNMENT or source.ctypes.data % WRITE_ALIGNMENT)
        if not (self.direct and aligned and whole):
            return self.write(data)
        if self._filled:
            self._hand_out(self._filled)
        self._handed.acquire()  # waits for the disk to take an earlier one
        self._raise_error()
        self._queue((source[:whole], whole, self._offset, False))
        self._offset += whole
        self.write(source[whole:])
        return len(source)

    def _hand_out(self, length: int) -> None:
        """Queue the current buffer's first ``length`` bytes for the helper thread."""
        assert self._current is not None
        self._queue((self._current, length, self._offset, True))
        self._offset += self._filled
        self._current, self._filled = None, 0

    def _queue(self, job: tuple[np.ndarray, int, int, bool]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._write_out, name="de_store-direct-write", daemon=True
            )
            self._thread.start()
        self._jobs.put(job)

    def _write_out(self) -> None:
        while (job := self._jobs.get()) is not None:
            buffer, length, offset, own = job
            try:
                if self._error is None:
                    self._write_at(buffer[:length], offset)
            except BaseException as err:  # raised to the writer by write() or sync()
                self._error = err
            finally:
                if own:
                    self._free.put(buffer)
                else:
                    self._handed.release()
            del job, buffer  # data handed over is let go once written

    def _write_at(self, view: Any, offset: int) -> None:
        try:
            _pwrite_all(self._fd, view, offset)
        except OSError as err:
            if err.errno != errno.EINVAL or not self.direct:
                raise
            self.direct = False
            set_direct(self._fd, on=False)
            _pwrite_all(self._fd, view, offset)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _stop(self) -> None:
        """Wait for the helper thread to write what it was handed, and end it."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def sync(self) -> None:
        """Write the last buffer (padded), wait for every write, cut the file to its
        length and fsync it."""
        size = self._offset + self._filled
        if self._filled:
            padded = -(-self._filled // WRITE_ALIGNMENT) * WRITE_ALIGNMENT
            assert self._current is not None
            self._current[self._filled : padded] = 0
            if self._thread is None:  # a file of one buffer: written here
                self._write_at(self._current[:padded], self._offset)
                self._offset, self._filled = size, 0
            else:
                self._hand_out(padded)
        self._stop()
        self._raise_error()
        os.ftruncate(self._fd, size)
        os.fsync(self._fd)

    def close(self) -> None:
        """End the helper thread (the owner closes the descriptor)."""
        self._stop()
        super().close()


def set_direct(fd: int, *, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; False where the filesystem refuses it."""
    import fcntl  # POSIX only: called only where the system has O_DIRECT

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        return False
    return True


def _pwrite_all(fd: int, view: Any, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (a write that takes nothing is an error, not a
    loop without end)."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if not n:
            raise OSError(errno.EIO, f"the disk took none of {len(view) - done} bytes")
        done += n
