"""Errors partrain raises on purpose.

`UsageError` is bad input from the user: the CLI prints its message as one line
and exits with status 2, never with a traceback.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input: the message says what was expected and what was received."""


class WorkerError(RuntimeError):
    """A worker process failed; carries its rank and traceback."""

    def __init__(self, rank: int, summary: str, traceback: str = "", role: str = "worker"):
        self.rank = rank
        self.role = role
        self.summary = summary
        self.traceback = traceback
        super().__init__(f"{role} rank {rank} failed: {summary}")
