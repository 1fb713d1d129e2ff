"""All errors raised by de_store.

Every error derives from :class:`DeStoreError`. Messages name the variable, file or rank
they are about, what was expected and what was found. Backend errors are translated at the
boundary with ``raise ... from err`` so the original cause stays attached.
"""

from __future__ import annotations


class DeStoreError(Exception):
    """Base class of every error raised by de_store."""


class TableError(DeStoreError):
    """A table core operation failed (capacity, device, internal state)."""


class RepeatedKeysError(TableError, ValueError):
    """A bulk load (``load_distinct``) got keys present already or repeated in it."""


class BackendError(DeStoreError):
    """A storage backend operation failed."""


class UnknownProtocolError(BackendError, ValueError):
    """A URL names a protocol that no installed fsspec implementation serves."""


class MissingDependencyError(BackendError, ImportError):
    """A protocol is known but the package that implements it is not installed."""


class StorageNotFoundError(BackendError, FileNotFoundError):
    """A file or object does not exist."""


class AlreadyExistsError(BackendError, FileExistsError):
    """A write-once object (commit marker, manifest) already exists."""


class FormatError(DeStoreError, ValueError):
    """A shard file is foreign, truncated, or does not match its expected schema."""


class ChecksumError(FormatError):
    """A file's crc32c does not match the one recorded when it was written."""


class CheckpointError(DeStoreError):
    """A checkpoint is missing, uncommitted, incomplete or inconsistent."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint exists at the given path."""


class BarrierTimeoutError(CheckpointError, TimeoutError):
    """Some ranks did not reach a barrier in time; the message names them."""


class VariableError(DeStoreError, ValueError):
    """A ``de_store.Variable`` was created or called with a bad device, dim, dtype or shape."""


class SaveInterruptedError(CheckpointError):
    """A save was interrupted (``KeyboardInterrupt``) before its commit; nothing committed."""


class DestinationError(BackendError):
    """A checkpoint cannot be written where it is aimed: a file is in the way, the folder
    cannot be written, or the bucket does not take the object written to test it."""


class StorageUnreachableError(BackendError, ConnectionError):
    """The storage server of a URL cannot be reached (no network, or a wrong endpoint)."""


class CheckpointMismatchError(CheckpointError):
    """A KV checkpoint was not saved with the TF checkpoint that restores it."""


class GCRefusedError(DeStoreError, ValueError):
    """``gc`` was pointed at a location it must not clean (a checkpoint, or a folder that
    holds checkpoints deeper down)."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint's manifest and files disagree, or its rows break a rule every
    checkpoint keeps (a rank or shard missing, a key in the wrong bucket, a null or repeated
    key, a byte range outside its file); the message names the file."""


class StorageOptionError(BackendError, ValueError):
    """A storage option that the storage's filesystem does not know (a misspelling)."""
