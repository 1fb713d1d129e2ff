"""Test utilities shipped with de_store: real S3 (moto) and GCS (emulator) servers, and
the conformance suites of its plug points.

- :mod:`de_store.testing.backend_suite`: ``BackendTests``, for a storage backend;
- :mod:`de_store.testing.format_suite`: ``ShardFormatTests`` and
  ``ColumnarShardFormatTests``, for a shard format;
- :mod:`de_store.testing.table_suite`: ``TableCoreTests``, for a table core.

A new implementation subclasses its suite, as de_store's own tests do (see
``docs/testing.md``). The suites import pytest, a test dependency, so they are imported
from their modules only; this package imports neither pytest nor TensorFlow.
Usable by de_store's own tests and benchmarks, and by users testing code built on it.
"""

from .servers import (
    StorageLocation,
    gcs_storage_options,
    reset_gcs_emulator,
    reset_moto_server,
    s3_storage_options,
    start_gcs_emulator,
    start_moto_server,
)

__all__ = [
    "StorageLocation",
    "gcs_storage_options",
    "reset_gcs_emulator",
    "reset_moto_server",
    "s3_storage_options",
    "start_gcs_emulator",
    "start_moto_server",
]
