"""The conformance suite on fsspec's in-process memory filesystem."""

from __future__ import annotations

import pytest

from de_store.backends.memory import MemoryBackend
from de_store.testing import StorageLocation
from de_store.testing.backend_suite import BackendTests


class TestMemoryBackend(BackendTests):
    @pytest.fixture
    def location(self, memory_location: StorageLocation) -> StorageLocation:
        return memory_location


def test_memory_url_opens_memory_backend(memory_location: StorageLocation) -> None:
    assert isinstance(memory_location.open(), MemoryBackend)
