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
