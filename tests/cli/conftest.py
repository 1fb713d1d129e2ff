"""The CLI tests' sample checkpoint: one per test module that asks for it."""

from __future__ import annotations

import pytest

from de_store.testing.sample import sample_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small committed checkpoint (300 rows, step 12)."""
    return sample_checkpoint(str(tmp_path_factory.mktemp("ckpt")), rows=300, step=12)
