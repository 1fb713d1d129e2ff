"""``Location``: a backend and a path as one value, joined with ``/``, with its URL."""

from __future__ import annotations

from pathlib import Path

from de_store.backends import Location, open_backend


def test_a_location_joins_parts_and_says_its_url(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path) + "/")
    root = Location(backend)
    checkpoint = root / "run" / "ckpt-3/"
    assert (root.path, checkpoint.path) == ("", "run/ckpt-3")
    assert checkpoint.url == backend.url.rstrip("/") + "/run/ckpt-3"
    assert checkpoint.url.endswith(f"{tmp_path}/run/ckpt-3")
    assert (checkpoint / "COMMIT-1").name == "COMMIT-1"
    assert (checkpoint / "").path == "run/ckpt-3"
    assert checkpoint.parent == root / "run" and root.parent == root
    assert str(checkpoint / "manifest-1.json") == (checkpoint / "manifest-1.json").url


def test_a_location_reads_what_its_backend_wrote_at_its_path(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    where = Location(backend, "/a/b/")
    backend.write_bytes((where / "x.bin").path, b"payload")
    assert (tmp_path / "a" / "b" / "x.bin").read_bytes() == b"payload"
    assert where.url == backend.url.rstrip("/") + "/a/b"
