"""Test utilities shipped with de_store: real S3 (moto) and GCS (emulator) servers.

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
