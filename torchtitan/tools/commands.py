"""Commands printed for a user to paste: they name the interpreter that is running now."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def python_command() -> str:
    """This interpreter as a shell word: relative to the current folder when it is inside it
    (``.venv/bin/python``), else its absolute path. A bare ``python`` may be another one,
    without this project's dependencies."""
    executable = Path(sys.executable)
    try:
        shown = str(executable.relative_to(Path.cwd()))
    except ValueError:
        shown = str(executable)
    return shlex.quote(shown)
