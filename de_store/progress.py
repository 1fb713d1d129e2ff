"""A dependency-free progress bar for long operations (verify, convert, the demo).

Callers report work done with :meth:`Progress.update`; :data:`NO_PROGRESS` is the no-op
default (as fsspec's ``NoOpCallback``). A bar draws on a terminal only.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 28
_REDRAW_S = 0.1


class Progress:
    """Reports work done towards ``total``; draws nothing unless ``enabled``.

    Parameters
    ----------
    total: units of work (bytes, rows) expected in all.
    label: what is being done, shown before the bar.
    enabled: draw the bar; see :func:`progress_for` for the usual choice.
    unit: "B" to show sizes in MB, anything else to show counts.
    stream: where to draw (stderr by default).
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        enabled: bool = True,
        unit: str = "B",
        stream: TextIO | None = None,
    ) -> None:
        self.total, self.label, self.enabled, self.unit = max(total, 0), label, enabled, unit
        self.done = 0
        self._stream = stream or sys.stderr
        self._drawn = 0.0

    def update(self, amount: int) -> None:
        """Count ``amount`` more units done."""
        self.done += amount
        if self.enabled and time.monotonic() - self._drawn >= _REDRAW_S:
            self._draw()

    def close(self) -> None:
        """Draw the final state and end the line."""
        if self.enabled:
            self._draw()
            self._stream.write("\n")
            self._stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _amount(self, n: int) -> str:
        return f"{n / 1e6:.1f} MB" if self.unit == "B" else f"{n:,}"

    def _draw(self) -> None:
        self._drawn = time.monotonic()
        share = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(share * _WIDTH)
        bar = "#" * filled + "." * (_WIDTH - filled)
        self._stream.write(
            f"\r{self.label} [{bar}] {share:4.0%} {self._amount(self.done)}"
            f" / {self._amount(self.total)}"
        )
        self._stream.flush()


#: Reports nothing; the default where no progress is wanted.
NO_PROGRESS = Progress(0, "", enabled=False)


def progress_for(total: int, label: str, *, quiet: bool = False, unit: str = "B") -> Progress:
    """A bar on stderr when it is a terminal and not ``quiet``; silent otherwise."""
    return Progress(total, label, enabled=not quiet and sys.stderr.isatty(), unit=unit)
