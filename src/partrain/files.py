"""Output paths checked before the work that produces their content."""

from __future__ import annotations

import os

from .errors import UsageError


def check_output_file(path: str, flag: str) -> None:
    """Raise `UsageError` now if ``path`` cannot be written later (a run's results would be lost).

    Checked before the load runs: the parent directory must exist and be
    writable, and ``path`` must not be a directory.
    """
    if not path:
        raise UsageError(f"Expected a file name for {flag}. Received: an empty string")
    if os.path.isdir(path):
        raise UsageError(f"Expected a file to write for {flag}. Received: {path!r}, a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        why = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise UsageError(f"Expected {flag} in an existing directory. Received: {path!r} ({parent!r} {why})")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"Expected {flag} to be writable. Received: {path!r} (permission denied)")
