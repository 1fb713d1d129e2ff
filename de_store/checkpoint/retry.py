"""Retrying idempotent storage steps with exponential backoff.

The saver retries whole steps that can be repeated without effect: writing one shard file
(each attempt writes a new file name), a rank manifest, a barrier arrival, reading one
manifest or shard. A partially written stream is never resumed. A write-once step (the
commit marker) that failed ambiguously is retried only through :func:`write_once_checked`,
which first looks whether its own content landed, so a checkpoint is never committed twice.
Each retry logs a WARNING under ``de_store.checkpoint.retry`` naming its cause.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from de_store.backends.base import Backend
from de_store.errors import (
    AlreadyExistsError,
    BackendError,
    DestinationError,
    MissingDependencyError,
    StorageNotFoundError,
    UnknownProtocolError,
)

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Causes that retrying cannot fix (missing file, bad credentials, wrong kind of path).
_PERMANENT_CAUSES = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                     NotADirectoryError)  # fmt: skip
_PERMANENT_ERRORS = (
    StorageNotFoundError,
    AlreadyExistsError,
    DestinationError,
    MissingDependencyError,
    UnknownProtocolError,
)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failed storage step is tried again.

    Attributes
    ----------
    attempts: tries per step, the first included; 1 disables retries.
    initial_backoff_s: wait before the second try; doubled after each failure.
    max_backoff_s: longest wait between two tries.
    """

    attempts: int = 4
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                "RetryPolicy needs 0 <= initial_backoff_s <= max_backoff_s, got "
                f"{self.initial_backoff_s!r} and {self.max_backoff_s!r}"
            )

    def call(self, step: Callable[[], T]) -> T:
        """Run ``step``; on a transient error wait and run it again, up to ``attempts``."""
        delay = self.initial_backoff_s
        for attempt in range(1, self.attempts + 1):
            try:
                return step()
            except Exception as err:
                if attempt == self.attempts or not is_transient(err):
                    raise
                wait = delay * random.uniform(0.5, 1.0)
                _log_retry(err, attempt, self.attempts, wait)
            time.sleep(wait)
            delay = min(2 * delay, self.max_backoff_s)
        raise AssertionError("unreachable")


NO_RETRY = RetryPolicy(attempts=1)


def _log_retry(err: Exception, attempt: int, attempts: int, wait: float) -> None:
    cause = str(err).splitlines()[0] if str(err) else ""
    logger.warning(
        "storage step failed (try %d of %d), retrying in %.2f s: %s: %s",
        attempt,
        attempts,
        wait,
        type(err).__name__,
        cause,
    )


def is_transient(err: BaseException) -> bool:
    """Whether trying ``err``'s step again may succeed (network, throttling, I/O hiccups)."""
    if isinstance(err, _PERMANENT_ERRORS):
        return False
    if isinstance(err, BackendError):
        cause = err.__cause__
        return not isinstance(cause, _PERMANENT_CAUSES + _PERMANENT_ERRORS)
    return isinstance(err, (ConnectionError, TimeoutError)) or (
        isinstance(err, OSError) and not isinstance(err, _PERMANENT_CAUSES)
    )


def write_once_checked(backend: Backend, path: str, data: bytes, policy: RetryPolicy) -> None:
    """``backend.write_once`` with retries that never create ``path`` twice.

    An attempt can fail after its object was created (the reply was lost); the next attempt
    then finds ``path`` taken. It counts as done only if the content there is ``data``.
    """

    def attempt() -> None:
        try:
            backend.write_once(path, data)
        except AlreadyExistsError:
            if _content(backend, path) != data:
                raise
        except Exception:
            if _content(backend, path) != data:
                raise

    policy.call(attempt)


def _content(backend: Backend, path: str) -> bytes | None:
    try:
        return backend.read_bytes(path)
    except Exception:
        return None
