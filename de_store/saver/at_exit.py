"""Background saves still running when the interpreter exits are finished first.

At exit Python stops ``concurrent.futures`` from taking new work before it runs the
``atexit`` functions. A de_store save in the background (``de_store.save``, or TF's async
checkpoint thread, which TF joins from ``atexit``) submits work to thread pools while it
writes (checksums, background fsync, uploads), so it would fail at that point ("cannot
schedule new futures after interpreter shutdown") and a script's last checkpoint would be
lost. ``threading``'s own exit hooks run earlier, in reverse order of registration: the
hook registered here, after ``concurrent.futures``' one, waits for those saves while
everything still works.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # its exit hook is registered before ours
import threading
import weakref
from typing import Any

_FUTURES: set[concurrent.futures.Future[Any]] = set()
_FUTURES_LOCK = threading.Lock()
_ASYNC_HELPERS: weakref.WeakSet[Any] = weakref.WeakSet()


def track(future: concurrent.futures.Future[Any]) -> None:
    """Finish ``future`` (a background save) before the interpreter exits."""
    with _FUTURES_LOCK:
        _FUTURES.add(future)
    future.add_done_callback(_forget)


def _forget(future: concurrent.futures.Future[Any]) -> None:
    with _FUTURES_LOCK:
        _FUTURES.discard(future)


def track_async_checkpoints() -> None:
    """Finish TF's async checkpoint saves before the interpreter exits (idempotent)."""
    from de_store.saver import tf_compat

    tf_compat.on_async_helper_created(_ASYNC_HELPERS.add)


def finish_pending() -> None:
    """Wait for every tracked save. Errors stay with their owners: a future keeps its
    error for ``result()``, TF's helper raises its own at its ``atexit`` join."""
    for async_helper in list(_ASYNC_HELPERS):
        # TF's own ``sync`` (waits only), not de_store's wrapper that raises.
        sync = type(async_helper).sync
        getattr(sync, "__wrapped__", sync)(async_helper)
    with _FUTURES_LOCK:
        pending = list(_FUTURES)
    concurrent.futures.wait(pending)


threading._register_atexit(finish_pending)  # type: ignore[attr-defined]
