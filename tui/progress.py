"""Progress bars on stderr for the long steps: splitting a model, fetching shards."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn


@contextlib.contextmanager
def progress_bar(description: str, in_bytes: bool) -> Iterator[Callable[[int, int], None]]:
    """A callback `(done, total)` that draws one bar; the bar is removed when done."""
    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += [DownloadColumn()] if in_bytes else [TextColumn("{task.completed}/{task.total}")]
    columns.append(TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)
            if done >= total:  # finished: take the bar off the screen, the work goes on
                bar.stop()

        yield update


class StageBars:
    """A progress callback `(stage, done, total)` for work that comes back (a re-plan splits
    again): a bar per run of a stage, removed when the stage is done."""

    def __init__(self) -> None:
        self._bar: contextlib.ExitStack | None = None
        self._update: Callable[[int, int], None] | None = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self._bar is None:
            self._bar = contextlib.ExitStack()
            self._update = self._bar.enter_context(progress_bar(stage, in_bytes=False))
        assert self._update is not None
        self._update(done, total)
        if done >= total:
            self._bar.close()
            self._bar = None
