"""Progress bars for long operations (save, restore, verify, convert), drawn by ``rich``.

Callers report work done with :meth:`Progress.update`; :data:`NO_PROGRESS` is the no-op
default (as fsspec's ``NoOpCallback``). A bar shows the share done, the amount, the rate
and the time left, on a terminal only; ``rich`` (a dependency of keras) is imported only
when a bar is drawn.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID


class Progress:
    """Reports work done towards ``total``; draws nothing unless ``enabled``.

    Parameters
    ----------
    total: units of work (bytes, rows, shards) expected in all; may be set later.
    label: what is being done, shown before the bar.
    enabled: draw the bar; see :func:`progress_for` for the usual choice.
    unit: "B" to show sizes (kB, MB, ...) and a rate in bytes per second; any other unit
        (e.g. "rows") is shown after counts and rates.
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
        self.label, self.enabled, self.unit = label, enabled, unit
        self.done = 0
        self._total = max(total, 0)
        self._stream = stream
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None

    @property
    def total(self) -> int:
        """Units of work expected in all."""
        return self._total

    @total.setter
    def total(self, value: int) -> None:
        self._total = max(value, 0)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, total=self._total)

    def update(self, amount: int) -> None:
        """Count ``amount`` more units done."""
        self.done += amount
        if self.enabled:
            bar, task = self._started()
            bar.update(task, completed=self.done)

    def close(self) -> None:
        """Draw the final state and stop drawing."""
        if self.enabled:
            bar, task = self._started()
            bar.update(task, completed=self.done, total=self._total or self.done)
            bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _started(self) -> tuple[RichProgress, TaskID]:
        if self._bar is None or self._task is None:
            self._bar = _rich_bar(self.unit, self._stream or sys.stderr)
            self._task = self._bar.add_task(self.label, total=self._total)
            self._bar.start()
        return self._bar, self._task


def _rich_bar(unit: str, stream: TextIO) -> RichProgress:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, TaskProgressColumn, TextColumn
    from rich.progress import Progress as RichProgress

    amount = DownloadColumn() if unit == "B" else TextColumn(_count_format(unit))
    return RichProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        amount,
        *_rate_and_eta_columns(unit),
        console=Console(file=stream),
        redirect_stdout=False,  # a background save must not swap the process's streams
        redirect_stderr=False,
    )


def _count_format(unit: str) -> str:
    return "{task.completed:,.0f}/{task.total:,.0f} " + unit.replace("{", "{{")


def _rate_and_eta_columns(unit: str) -> list[Any]:
    """The average rate since the start (``1.2 MB/s``, ``3,400 rows/s``) and the time left
    at that rate (``ETA 0:01:05``)."""
    from rich.filesize import decimal
    from rich.progress import ProgressColumn, Task
    from rich.text import Text

    def rate_of(task: Task) -> float | None:
        elapsed = task.finished_time or task.elapsed
        return task.completed / elapsed if elapsed and task.completed else None

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            rate = rate_of(task)
            if rate is None:
                return Text(f"? {unit}/s")
            return Text(f"{decimal(int(rate))}/s" if unit == "B" else f"{rate:,.0f} {unit}/s")

    class Eta(ProgressColumn):
        def render(self, task: Task) -> Text:
            rate = rate_of(task)
            if not task.total or rate is None:
                return Text("ETA -:--:--")
            seconds = int(max(task.total - task.completed, 0) / rate)
            return Text(f"ETA {seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}")

    return [Rate(), Eta()]


#: Reports nothing; the default where no progress is wanted.
NO_PROGRESS = Progress(0, "", enabled=False)


def progress_for(total: int, label: str, *, quiet: bool = False, unit: str = "B") -> Progress:
    """A bar on stderr when it is a terminal and not ``quiet``; silent otherwise."""
    return Progress(total, label, enabled=not quiet and sys.stderr.isatty(), unit=unit)
