"""Shared fixtures: real storage locations for every backend de_store supports.

Session fixtures start one moto S3 server and one gcp-storage-emulator on 127.0.0.1 (free
ports) the first time a test asks for them; function fixtures wipe them and hand out a fresh
bucket, so tests never see each other's objects.

Using them from another test module
-----------------------------------
Ask for ``storage_location`` to run a test once per backend (local, memory, s3, gcs)::

    def test_roundtrip(storage_location):
        backend = storage_location.open()          # a de_store Backend
        # or: open_backend(storage_location.url, storage_location.storage_options)

``storage_location`` is a :class:`de_store.testing.StorageLocation` (``name``, ``url``,
``storage_options``). For one backend only, ask for ``local_location``,
``memory_location``, ``s3_location`` or ``gcs_location``; ``moto_endpoint`` and
``gcs_endpoint`` give the raw server URLs.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

# The kernel cache of this test session, fresh each run (the processes that tests
# start inherit it): the first use of a kernel traces it, later processes load it.
_CACHE_DIR = os.environ["DE_STORE_CACHE_DIR"] = tempfile.mkdtemp(prefix="de_store_test_cache_")

import pytest
import tensorflow as tf

# Four logical CPUs for multi-shard tests. It must happen before TensorFlow initializes its
# devices, which any earlier test module's first op would do: hence here, at import.
_CPU = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_CPU, [tf.config.LogicalDeviceConfiguration()] * 4)

from de_store.testing import servers  # noqa: E402
from de_store.testing.servers import StorageLocation  # noqa: E402

#: tests/keras2 run in their own process, under Keras 2 (see tests/keras2/conftest.py)
collect_ignore = (
    [] if os.environ.get("TF_USE_LEGACY_KERAS") in ("1", "true", "True") else ["keras2"]
)

BUCKET = "de-store-test"
BACKEND_NAMES = ["local", "memory", "s3", "gcs"]


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """URL of a moto S3 server running for the whole test session."""
    endpoint, stop = servers.start_moto_server()
    yield endpoint
    stop()


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    """URL of a gcp-storage-emulator running for the whole test session."""
    endpoint, stop = servers.start_gcs_emulator()
    yield endpoint
    stop()


@pytest.fixture
def local_location(tmp_path: Path) -> StorageLocation:
    """An empty local directory."""
    return StorageLocation("local", str(tmp_path / "store"))


@pytest.fixture
def memory_location() -> Iterator[StorageLocation]:
    """An empty prefix of fsspec's memory filesystem, deleted afterwards."""
    location = StorageLocation("memory", f"memory://de-store-test-{uuid.uuid4().hex}")
    yield location
    location.open().delete("", recursive=True)


@pytest.fixture
def s3_location(moto_endpoint: str) -> StorageLocation:
    """A prefix in a fresh bucket of the (wiped) moto server."""
    servers.reset_moto_server(moto_endpoint)
    options = servers.s3_storage_options(moto_endpoint)
    servers.create_bucket("s3", BUCKET, options)
    return StorageLocation("s3", f"s3://{BUCKET}/root", options)


@pytest.fixture
def gcs_location(gcs_endpoint: str) -> StorageLocation:
    """A prefix in a fresh bucket of the (wiped) GCS emulator."""
    servers.reset_gcs_emulator(gcs_endpoint)
    options = servers.gcs_storage_options(gcs_endpoint)
    servers.create_bucket("gs", BUCKET, options)
    return StorageLocation("gcs", f"gs://{BUCKET}/root", options)


@pytest.fixture(params=BACKEND_NAMES)
def storage_location(request: pytest.FixtureRequest) -> StorageLocation:
    """One empty location per backend: local dir, memory://, S3 (moto), GCS (emulator)."""
    location: StorageLocation = request.getfixturevalue(f"{request.param}_location")
    return location


#: Modules whose fixtures or tests take minutes (``pytest --durations=40``: the PS
#: clusters' module fixtures, the Keras 2 suite's child process), longest first. They are
#: handed to the workers first and the other modules after them, most tests first: given
#: last, one of them kept one worker busy for minutes after the other had finished.
LONG_MODULES = (
    "tests/distribute/test_ps_tfra.py",
    "tests/distribute/test_ps.py",
    "tests/test_keras2_suite.py",
    "tests/faults/test_faults_readers.py",
    "tests/distribute/test_ps_restore.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the modules for ``--dist loadscope`` (see :data:`LONG_MODULES`); the tests of
    a module keep their order."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(path: str) -> tuple[int, int]:
        first = LONG_MODULES.index(path) if path in LONG_MODULES else len(LONG_MODULES)
        return first, -len(modules[path])

    items[:] = [item for path in sorted(modules, key=rank) for item in modules[path]]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)
