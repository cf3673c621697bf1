"""Rich progress bars for the long steps (silent when disabled, e.g. in tests)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class _Silent:
    def advance(self, amount: int = 1) -> None:
        pass


class _Bar:
    def __init__(self, progress: Progress, task):
        self._progress, self._task = progress, task

    def advance(self, amount: int = 1) -> None:
        self._progress.advance(self._task, amount)


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[_Bar | _Silent]:
    if not enabled:
        yield _Silent()
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        yield _Bar(progress, progress.add_task(description, total=total))
