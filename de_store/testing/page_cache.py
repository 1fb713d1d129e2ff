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


def reads_from_disk(path: str | os.PathLike[str]) -> bool:
    """Whether the file ``path`` can leave the page cache and be read with ``O_DIRECT``:
    False on tmpfs and ramfs (whose pages are the files), where ``open`` refuses
    ``O_DIRECT``, and off Linux."""
    path = os.path.realpath(path)
    if not hasattr(os, "O_DIRECT") or _filesystem(path) in ("tmpfs", "ramfs"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def _filesystem(path: str) -> str:
    """The type of the filesystem mounted deepest above ``path`` (``/proc/self/mounts``)."""
    found, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fstype, *_ = line.split()
            point = point.replace("\\040", " ")
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(found):
                found, kind = point, fstype
    return kind
