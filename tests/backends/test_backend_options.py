"""Storage options are checked against what the storage's filesystem knows: a misspelt
one is refused, naming it and the known ones; the options the fixtures use still work."""

from __future__ import annotations

import pytest

from de_store.backends import open_backend
from de_store.errors import StorageOptionError
from de_store.testing import StorageLocation


@pytest.mark.parametrize(
    "fixture, misspelt, meant",
    [
        ("local_location", "auto_mkdirr", "auto_mkdir"),
        ("s3_location", "endpoint_urll", "endpoint_url"),
        ("gcs_location", "projct", "project"),
    ],
)
def test_a_misspelt_storage_option_is_refused(
    request: pytest.FixtureRequest, fixture: str, misspelt: str, meant: str
) -> None:
    location: StorageLocation = request.getfixturevalue(fixture)
    options = {**location.storage_options, misspelt: True}
    with pytest.raises(StorageOptionError) as info:
        open_backend(location.url, options)
    message = str(info.value)
    assert f"unknown storage option(s) {misspelt!r} (did you mean {meant!r}?)" in message
    known = message.split("known options: ")[1].split(", ")
    assert meant in known and "skip_instance_cache" in known
    assert all(name in known for name in location.storage_options)
    backend = open_backend(location.url, location.storage_options)  # the fixture's options
    backend.write_bytes("probe", b"x")
    assert backend.read_bytes("probe") == b"x"


def test_known_options_of_each_filesystem_pass(
    local_location: StorageLocation, s3_location: StorageLocation
) -> None:
    open_backend(local_location.url, {"auto_mkdir": True, "use_listings_cache": False})
    options = {**s3_location.storage_options, "client_kwargs": {}, "anon": False}
    open_backend(s3_location.url, {**options, "skip_instance_cache": True})


def test_other_protocols_are_not_checked() -> None:
    """fsspec filesystems without a de_store backend may hand any keyword on (here HTTP
    headers, which HTTPFileSystem passes to each request): they go through as given."""
    backend = open_backend("http://127.0.0.1:9/x", {"headers": {"Authorization": "t"}})
    assert backend.fs.kwargs == {"headers": {"Authorization": "t"}}  # type: ignore[attr-defined]


def test_memory_options_are_checked() -> None:
    with pytest.raises(StorageOptionError, match="'global_storee' \\(did you mean"):
        open_backend("memory://options-probe", {"global_storee": {}})
