"""The CLI's two consoles (standard output, standard error), made once for every command.

Writing to a terminal, Rich uses its width. Writing to a pipe or a file (a script, `| less`,
`> out.txt`), Rich would assume 80 columns and wrap every wide table into unreadable cells (ids
split over lines, `c-se…`); there the consoles take ``PIPE_WIDTH`` columns instead, unless
``$COLUMNS`` says otherwise.
"""

import os
import sys
from typing import TextIO

from rich.console import Console

PIPE_WIDTH = 200
"""Columns a table may take when the output is not a terminal (and ``$COLUMNS`` is not set)."""


def _width(stream: TextIO) -> int | None:
    """None (Rich decides: the terminal's width, or ``$COLUMNS``) or :data:`PIPE_WIDTH`."""
    if os.environ.get("COLUMNS") or stream.isatty():
        return None
    return PIPE_WIDTH


console = Console(width=_width(sys.stdout))
err = Console(stderr=True, width=_width(sys.stderr))
