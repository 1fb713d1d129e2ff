"""Every error class a user may catch is importable from ``de_store`` and documented."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import de_store
from de_store import errors

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def error_classes() -> dict[str, type]:
    found = {
        name: cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, errors.DeStoreError)
    }
    found["InvalidValuesError"] = de_store.InvalidValuesError
    return found


def test_every_error_class_is_importable_from_de_store() -> None:
    classes = error_classes()
    assert len(classes) >= 20
    for name, cls in classes.items():
        assert getattr(de_store, name) is cls, name
        assert name in de_store.__all__, name
        assert issubclass(cls, errors.DeStoreError), name


def test_docs_list_every_error_class_with_its_bases() -> None:
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", DOC.read_text(), re.M))
    assert set(rows) == set(error_classes())
    for name, cls in error_classes().items():
        bases = [b.__name__ for b in cls.__bases__]
        documented = re.findall(r"`([\w.]+)`", rows[name])
        assert [d.rsplit(".", 1)[-1] for d in documented] == bases, name
