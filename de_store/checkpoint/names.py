"""Every file and folder name a save writes, with its parser: writers, readers, gc and
verify all ask this module."""

from __future__ import annotations

import re

from de_store.checkpoint._tf_bundle import file_name_ends as bundle_file_name_ends
from de_store.formats.binary import BinaryFormat

#: What a binary shard file's path gets to name the bundle its task writes it as.
BUNDLE_SUFFIX = ".tf"


def bundle_prefix(path: str) -> str:
    """The bundle a task writes as the binary shard file ``path`` (renamed to it after)."""
    return path + BUNDLE_SUFFIX


def device_shard_file_name_ends() -> str:
    """A regular expression for what the files of a shard written on its device add to
    the shard's path until the saving process renames them: a binary file's end, then its
    bundle's data file or index, complete or as TensorFlow names it while writing it."""
    binary = BinaryFormat.file_name_ends()
    return f"({binary}){re.escape(BUNDLE_SUFFIX)}{bundle_file_name_ends()}"
