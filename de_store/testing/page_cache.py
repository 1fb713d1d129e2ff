"""Make the next read of local files cold: what tests of reads from the disk and the
benchmarks' cold reads need."""

from __future__ import annotations

import os


def evict(root: str | os.PathLike[str]) -> None:
    """Evict a file, or every file under a folder, from the page cache (fsynced first:
    the kernel drops clean pages only). Linux; elsewhere ``posix_fadvise`` is missing."""
    root = os.fspath(root)
    paths = [root] if os.path.isfile(root) else []
    for folder, _, files in os.walk(root):
        paths += [os.path.join(folder, f) for f in files]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
