"""Tables for a person that never cut a value (issue 40): every dslurm command that prints a rich
table (`plan`, `plan simulate`, `report`, `ckpt ls`, `doctor`, the burn-in verdict) goes through
here.

rich sizes a console to the terminal, or to 80 columns when stdout is a file or a pipe, and then
shrinks a table that does not fit by folding and cutting its cells ("reque…", "81.0…"): a cut
number is a lost number. Here a table is always rendered at least as wide as its widest row needs;
in a terminal narrower than that, the terminal wraps the long lines, every digit still there.
Plain-text tables (`site check`, the sweep report, the phase tables) are f-strings, which never
cut. Every command that prints a table also has `--json`. rich loads only inside these functions.
"""

from __future__ import annotations

import io
from typing import IO, Any

WIDE = 10_000
"""the width of a console that does not print to a terminal: wide enough for any row"""


def console(file: IO[str] | None = None, **kw: Any) -> Any:
    """A rich Console on `file` (stdout): the terminal's width there, else WIDE (prose lines
    soft-wrap either way: a piped line is never folded at 80 columns)."""
    from rich.console import Console

    c = Console(file=file, **kw)
    return c if c.is_terminal or "width" in kw else Console(file=file, width=WIDE, **kw)


def print_table(con: Any, table: Any, **kw: Any) -> None:
    """Print `table` on `con` at least as wide as its widest row, so that rich cuts no cell."""
    from rich.console import Console
    from rich.measure import Measurement

    need = Measurement.get(con, con.options.update_width(WIDE), table).maximum  # unbounded, not the console's
    if need <= con.width:
        con.print(table, **kw)
        return
    wide = Console(file=con.file, width=need, color_system=con.color_system, force_terminal=con.is_terminal,
                   highlight=False)
    wide.print(table, **kw)


def render(table: Any) -> str:
    """The table as plain text, whole (for text that is returned rather than printed)."""
    from rich.console import Console

    buf = io.StringIO()
    print_table(Console(file=buf, width=WIDE, color_system=None), table)
    return buf.getvalue()
