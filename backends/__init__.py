"""Storage backends built on fsspec.

Open one with :func:`open_backend` (or a checkpoint's parent folder with
:func:`open_location`); the contract is :class:`Backend` in ``base``.
"""

from .base import Backend, Capabilities, IOStats
from .location import Location
from .registry import BackendSpec, backend_class, open_backend, open_location, register_backend

__all__ = [
    "Backend",
    "BackendSpec",
    "Capabilities",
    "IOStats",
    "Location",
    "backend_class",
    "open_backend",
    "open_location",
    "register_backend",
]
