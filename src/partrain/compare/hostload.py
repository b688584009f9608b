"""What else used the host's CPU while a window ran: the hypervisor (steal) and other processes.

compare measures its strategies one after the other, so a window that shared the machine with
something else (another job, a browser, a noisy neighbour on a cloud VM) runs slower than its
neighbours for reasons that are not the strategy's. Each window therefore records, from Linux's
``/proc/stat`` and the ``/proc/PID/stat`` of this process and its descendants (the windows'
workers and servers):

- ``steal``: the share of the host's CPU time the hypervisor gave to other guests;
- ``other``: the share that processes outside this process tree used (busy time, minus this
  tree's own user and system time).

Both are shares of every core's time over the window (``0.25`` on 2 cores: half a core). Where
``/proc`` is missing (macOS, Windows) the figures are NaN and nothing is said of them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .measure import Measurement

#: a window whose host load (steal + other) differs from another's by more than this is flagged
SPREAD_WARNING = 0.15


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU ticks: every core's (``total``), busy (user, nice, system, irq, softirq),
    stolen, and this process tree's own user + system."""

    total: int
    busy: int
    steal: int
    own: int


def parse_proc_stat(text: str) -> tuple[int, int, int]:
    """``(total, busy, steal)`` ticks from ``/proc/stat``'s first (all-cores) line.

    Its fields: user nice system idle iowait irq softirq steal guest guest_nice; guest time is
    already inside user, so the total is the first eight."""
    first = text.splitlines()[0].split()
    if not first or first[0] != "cpu":
        raise ValueError(f"Expected /proc/stat to start with a 'cpu' line. Received: {text[:40]!r}")
    v = [int(x) for x in first[1:9]] + [0] * max(0, 8 - len(first[1:9]))
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    return sum(v[:8]), user + nice + system + irq + softirq, steal


def parse_pid_stat(text: str) -> tuple[int, int]:
    """``(ppid, utime + stime)`` from a ``/proc/PID/stat`` line (the name may hold spaces and ')')."""
    rest = text[text.rindex(")") + 2:].split()
    # after the name: state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime
    return int(rest[1]), int(rest[11]) + int(rest[12])


def tree_ticks(root: int, stats: dict[int, str]) -> int:
    """User + system ticks of ``root`` and every descendant of it among ``stats`` (pid -> stat line)."""
    parsed = {}
    for pid, line in stats.items():
        try:
            parsed[pid] = parse_pid_stat(line)
        except (ValueError, IndexError):
            continue
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in parsed.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in parsed:
            total += parsed[pid][1]
        todo += children.get(pid, [])
    return total


def sample() -> CpuSample | None:
    """The host's and this process tree's CPU ticks now; None without a readable ``/proc``."""
    try:
        with open("/proc/stat") as f:
            total, busy, steal = parse_proc_stat(f.read())
    except (OSError, ValueError):
        return None
    stats: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stats[int(entry)] = f.read()
            except OSError:  # gone meanwhile
                continue
    return CpuSample(total, busy, steal, tree_ticks(os.getpid(), stats))


def shares(before: CpuSample | None, after: CpuSample | None) -> tuple[float, float]:
    """``(steal, other)`` between two samples, as shares of every core's time (NaN, NaN if unknown).

    A process of the tree that ended between the samples takes its ticks with it (``own``
    undercounts), so ``other`` is then an upper bound; both are clamped to [0, 1]."""
    if before is None or after is None or after.total <= before.total:
        return math.nan, math.nan
    span = after.total - before.total
    steal = (after.steal - before.steal) / span
    other = (after.busy - before.busy - (after.own - before.own)) / span
    return min(max(steal, 0.0), 1.0), min(max(other, 0.0), 1.0)


def spread_warning(measurements: Sequence[Measurement]) -> str | None:
    """One line when the measured windows (the run-off's too) ran under host loads further apart
    than `SPREAD_WARNING` (their ranking may then be the host's doing), else None."""
    loaded = [(m.label if i == 0 else f"{m.label}'s run-off window {i}", w.host_load)
              for m in measurements if m.ok for i, w in enumerate((m, *m.runoff)) if w.host_load == w.host_load]
    if len(loaded) < 2:
        return None
    low, high = min(loaded, key=lambda x: x[1]), max(loaded, key=lambda x: x[1])
    if high[1] - low[1] <= SPREAD_WARNING:
        return None
    return (f"the windows ran under different host load ({high[0]}: {high[1]:.0%} of the CPU went elsewhere, "
            f"{low[0]}: {low[1]:.0%}); the ranking may be the host's doing: run compare again on a quieter "
            "machine")
