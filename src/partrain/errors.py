"""Errors partrain raises on purpose.

`UsageError` is bad input from the user: the CLI prints its message as one line
and exits with status 2, never with a traceback. `Interrupted` is SIGINT or
SIGTERM turned into an exception, so that a signal unwinds the program like
Ctrl-C does: every ``finally`` runs, the processes partrain started are stopped
and its temporary directories removed.
"""

from __future__ import annotations

import os
import signal
import sysconfig
import traceback
from types import TracebackType


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (torch's often span many lines)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def error_line(exc: BaseException) -> str:
    """``"Type: first line of the message"``: an exception as one line."""
    return f"{type(exc).__name__}: {first_line(exc)}"


def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the user's lives: partrain, the standard library, installed packages."""
    paths = sysconfig.get_paths()
    dirs = {os.path.dirname(os.path.abspath(__file__))}
    dirs.update(os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths)
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame of ``tb`` in the user's own code (a file outside partrain, the standard
    library and installed packages), or None when the error arose in none of it."""
    libraries = _library_dirs()
    found = None
    for frame in traceback.extract_tb(tb):
        name = frame.filename
        if name.startswith("<") or not os.path.isabs(name):
            continue
        if not os.path.realpath(name).startswith(libraries):
            found = frame
    return found


def where(frame: traceback.FrameSummary) -> str:
    """``path:line, in function`` (the path relative to the working directory when under it)."""
    path = os.path.abspath(frame.filename)
    rel = os.path.relpath(path)
    return f"{path if rel.startswith('..') else rel}:{frame.lineno}, in {frame.name}"


def exception_line(exc: BaseException, hint: str | None = None) -> str:
    """An exception as one line, with the user's file and line when it came through their code:
    ``RuntimeError: shapes differ (model.py:14, in forward)``; ``hint`` goes inside the brackets."""
    line = error_line(exc) if first_line(exc) else type(exc).__name__
    frame = user_frame(exc.__traceback__)
    notes = [where(frame)] if frame is not None else []
    notes += [hint] if hint else []
    return f"{line} ({'; '.join(notes)})" if notes else line


class UsageError(ValueError):
    """Bad input: the message says what was expected and what was received."""


class MainGuardError(UsageError):
    """A script runs `fit`/`launch` at import time, so every spawned worker runs it again."""


class RunFailed(RuntimeError):
    """The run ended, but what it produced means nothing (non-finite figures): a non-zero exit."""


class WorkerError(RuntimeError):
    """A worker process failed; carries its rank and traceback."""

    def __init__(self, rank: int, summary: str, traceback: str = "", role: str = "worker",
                 who: str | None = None):
        """``who`` names the process when its rank alone says too little (``stage 1 (rank 1)``)."""
        self.rank = rank
        self.role = role
        self.summary = summary
        self.traceback = traceback
        super().__init__(f"{who or f'{role} rank {rank}'} failed: {summary}")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived. A `KeyboardInterrupt`: code that handles Ctrl-C handles it too.

    ``signum`` is the signal; ``exit_status`` the shell's convention for a process it
    stopped (128 + signal: 130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal_name(signum)}")

    def __reduce__(self) -> tuple:
        return type(self), (self.signum,)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
