"""One progress reporter for every long job: rich bars on a terminal, nothing in tests or --json runs."""
from __future__ import annotations

from contextlib import contextmanager


class _NullTask:
    def advance(self, n: int = 1) -> None: ...
    def update(self, **kw) -> None: ...
    def done(self) -> None: ...


class Progress:
    """Hands out tasks; the base class shows nothing."""

    def task(self, description: str, total: int | None) -> _NullTask:
        return _NullTask()


null_progress = Progress()


class _RichTask:
    def __init__(self, bar, task_id):
        self.bar, self.id = bar, task_id

    def advance(self, n: int = 1) -> None:
        self.bar.advance(self.id, n)

    def update(self, **kw) -> None:
        self.bar.update(self.id, **kw)

    def done(self) -> None:
        self.bar.update(self.id, visible=False)


class RichProgress(Progress):
    def __init__(self, bar):
        self.bar = bar

    def task(self, description: str, total: int | None) -> _RichTask:
        return _RichTask(self.bar, self.bar.add_task(description, total=total))


@contextmanager
def rich_progress(console=None, enabled: bool = True):
    """A live progress display (description, bar, count, elapsed, ETA) for the duration of a job."""
    if not enabled:
        yield null_progress
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
              TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True)
    with bar:
        yield RichProgress(bar)
