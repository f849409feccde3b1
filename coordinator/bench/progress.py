"""Where a long benchmark is, for the person waiting on it.

A group calls ``progress.phase(name, runs)`` around each metric's measurements
(and around long preparation) and ``progress.advance()`` after each run, always
between timed sections, never inside one. ``Progress`` itself does nothing: what
library callers and tests get. The ``coordinator bench`` command passes the
one from ``shown_on(stderr)``, which draws a line with rich on an interactive
terminal and is ``NO_PROGRESS`` anywhere else (a pipe, a file, ``--json``).

The drawing never runs on a thread of its own: a refresh thread would take the
GIL in the middle of a timed section, and the runtime group measures exactly
such stalls (event-loop lag). It redraws at each ``phase`` and ``advance``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import rich.progress

__all__ = ["NO_PROGRESS", "Progress", "shown_on"]


class Progress:
    """Progress that shows nothing."""

    @contextlib.contextmanager
    def phase(self, name: str, runs: int | None = None) -> Iterator[None]:
        """The block measures ``name`` (a metric, or what prepares one) in ``runs`` runs."""
        yield

    def advance(self) -> None:
        """One run of the innermost phase is done."""


NO_PROGRESS = Progress()


class _Terminal(Progress):
    """One line per open phase: group, phase, a bar, run i of n, time in the phase."""

    def __init__(self, bar: rich.progress.Progress, group: str) -> None:
        self._bar = bar
        self._group = group
        self._open: list[rich.progress.TaskID] = []

    @contextlib.contextmanager
    def phase(self, name: str, runs: int | None = None) -> Iterator[None]:
        task = self._bar.add_task(name, total=runs, group=self._group, runs=_runs(0, runs))
        self._open.append(task)
        self._bar.refresh()
        try:
            yield
        finally:
            self._open.remove(task)
            self._bar.remove_task(task)

    def advance(self) -> None:
        if not self._open:
            return
        task = self._open[-1]
        self._bar.advance(task)
        state = self._bar.tasks[self._bar.task_ids.index(task)]
        total = None if state.total is None else int(state.total)
        self._bar.update(task, runs=_runs(int(state.completed), total))
        self._bar.refresh()


def _runs(done: int, runs: int | None) -> str:
    """The run under way, 1-based ("run 2/5"); "done" once all are."""
    if runs is None:
        return ""
    return "done" if done >= runs else f"run {done + 1}/{runs}"


def _interactive(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # closed, or not a real stream
        return False


@contextlib.contextmanager
def shown_on(stream: TextIO, group: str, *, enabled: bool = True) -> Iterator[Progress]:
    """A ``Progress`` drawn on ``stream`` while the block runs, if ``enabled`` and the
    stream is an interactive terminal; otherwise ``NO_PROGRESS``, which writes nothing.
    The lines are cleared when the block ends, so what follows prints on a clean screen."""
    if not enabled or not _interactive(stream):
        yield NO_PROGRESS
        return
    from rich.console import Console
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    console = Console(file=stream)
    if not console.is_interactive:  # TERM=dumb, TTY_INTERACTIVE=0: no cursor moves
        yield NO_PROGRESS
        return
    bar = Bar(
        TextColumn("{task.fields[group]}", style="bold", markup=False),
        TextColumn("{task.description}", markup=False),
        BarColumn(bar_width=20),
        TextColumn("{task.fields[runs]}"),
        TimeElapsedColumn(),
        console=console,
        auto_refresh=False,  # no drawing thread; see the module docstring
        transient=True,
        redirect_stdout=False,  # stdout is the report's, untouched
        redirect_stderr=False,
    )
    with bar:
        yield _Terminal(bar, group)
