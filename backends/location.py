"""A place on a backend: the backend and a path under its root, as one value.

``Location`` joins paths with ``/`` (``where / "COMMIT-3"``) and says where it is as a URL
(``where.url``), so that no caller builds ``f"{backend.url}/{path}"`` by hand; the backend
reads and writes at ``where.path``.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from .base import Backend


@dataclass(frozen=True)
class Location:
    """``path`` (relative, ``/``-separated; ``""`` for the root) on ``backend``."""

    backend: Backend
    path: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", self.path.strip("/"))

    def __truediv__(self, name: str) -> Location:
        """The location ``name`` (one or more ``/``-separated parts) under this one."""
        name = name.strip("/")
        if not name:
            return self
        return Location(self.backend, f"{self.path}/{name}" if self.path else name)

    @property
    def url(self) -> str:
        """Where this is, as a URL: the backend's URL and the path."""
        root = self.backend.url.rstrip("/")
        return f"{root}/{self.path}" if self.path else root

    @property
    def name(self) -> str:
        """The last part of the path (``""`` at the root)."""
        return posixpath.basename(self.path)

    @property
    def parent(self) -> Location:
        """The location one folder up (the root is its own parent)."""
        return Location(self.backend, posixpath.dirname(self.path))

    def __str__(self) -> str:
        return self.url
