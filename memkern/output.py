"""What the ``memkern`` commands print: tables and progress bars, laid out by ``rich``.

Tables are plain text (no colour, no box lines), as wide as the terminal allows: a header too
long for its column wraps inside it, at word boundaries, and is never cut nor run into the
next; numbers never wrap. Progress bars redraw in place on a terminal; written to a file or a
pipe, they print once, finished, with no carriage returns.
"""
from __future__ import annotations

import io
import shutil
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

LOG_WIDTH = 120
"""Width when the output is not a terminal (a log file, a pipe) and ``COLUMNS`` is not set."""


def width() -> int:
    """The terminal's width (or ``COLUMNS``); :data:`LOG_WIDTH` when there is no terminal."""
    return shutil.get_terminal_size((LOG_WIDTH, 24)).columns


def _widths(headers: Sequence[str], rows: Sequence[Sequence[str]], room: int) -> list[int]:
    """Each column's width within ``room`` characters: at least its widest cell and its
    header's longest word (the first column's names give way when nothing else fits), then
    what is left widens the columns whose headers would wrap, left to right, up to their
    length: headers on one line where the room allows."""
    widths = [max([len(row[i]) for row in rows] + [len(w) for w in h.split()])
              for i, h in enumerate(headers)]
    widths[0] = max(8, min(widths[0], room - sum(widths[1:])))
    spare = room - sum(widths)
    for i, header in enumerate(headers):
        grow = min(max(0, spare), max(0, len(header) - widths[i]))
        widths[i] += grow
        spare -= grow
    return widths


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *,
          columns: int | None = None) -> str:
    """``rows`` of text under ``headers``, as lines of at most ``columns`` characters (default:
    :func:`width`) where the cells allow it: the first column left-aligned, the others
    (numbers) right-aligned, two spaces between columns (one where two do not fit). A header
    longer than its column wraps inside it, between words; no number wraps; the first
    column's names wrap only when the others leave them less room than they need."""
    columns = columns or width()
    gap = 2 if sum(max([len(row[i]) for row in rows] + [len(w) for w in h.split()])
                   for i, h in enumerate(headers)) + 2 * (len(headers) - 1) <= columns else 1
    widths = _widths(headers, rows, columns - gap * (len(headers) - 1))
    # SIMPLE_HEAD: a rule under the header, and a one-space divider between columns (the
    # gap's last space; the rest is the column's left padding, which its width includes)
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, gap - 1))
    for i, (header, w) in enumerate(zip(headers, widths)):
        t.add_column(header, justify="left" if i == 0 else "right",
                     width=w, overflow="fold")
    for row in rows:
        t.add_row(*row)
    console = Console(file=io.StringIO(), width=max(columns, sum(widths) + gap * len(widths)),
                      color_system=None, highlight=False, emoji=False, markup=False)
    console.print(t)
    return "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())


def progress(enabled: bool = True) -> Progress:
    """A progress display on stderr, one bar per task with its steps done of its total and a
    ``loss`` field: ``with progress() as p: task = p.add_task(name, total=n, loss="")``."""
    return Progress(TextColumn("  {task.description}"), BarColumn(bar_width=24),
                    MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                    console=Console(stderr=True, highlight=False), disable=not enabled)
