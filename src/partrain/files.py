"""Output paths checked before the work that produces their content."""

from __future__ import annotations

import os

from .errors import UsageError

#: files a run writes in its directory: their presence means the directory holds a run
RUN_FILES = ("checkpoint.pt", "best.pt", "checkpoint.dcp", "best.dcp", "metrics.csv", "metrics.jsonl", "config.json",
             "curves.png")


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


def numbered_dir(path: str, run_files: tuple[str, ...] = RUN_FILES) -> str:
    """``path`` when it holds no run, else the first free ``path-2``, ``path-3``, ..."""
    def taken(p: str) -> bool:
        return os.path.exists(p) and (not os.path.isdir(p) or any(os.path.exists(os.path.join(p, f)) for f in run_files))

    if not taken(path):
        return path
    n = 2
    while taken(f"{path}-{n}"):
        n += 1
    return f"{path}-{n}"


def run_dir(out: str | None, default: str, *, resume: bool, command: str, quiet: bool = False) -> str:
    """Where a command writes its run: ``out`` when given; else ``default`` (``runs/NAME``), or
    when that holds a run and this is no resume the first free ``default-2``, ``-3``, ... with
    a line that says so."""
    if out is not None:
        return out
    if resume:
        return default
    chosen = numbered_dir(default)
    if chosen != default and not quiet:
        print(f"partrain {command}: {default} holds a run; writing {chosen} (--out DIR to choose, --resume to "
              "continue)", flush=True)
    return chosen
