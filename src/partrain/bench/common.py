"""Helpers shared by the benchmarks: tables, JSON output, timing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, numbers right-aligned, floats to 3 significant places."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            if v != v:
                return "-"
            return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row, raw in zip(text, rows):
        parts = [c.rjust(w) if isinstance(v, (int, float)) else c.ljust(w) for c, w, v in zip(row, widths, raw)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def write_json(path: str | None, figures: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2, sort_keys=True)
            f.write("\n")


def best_of(fn: Callable[[], float], repeats: int) -> float:
    """Run ``fn`` (which returns a rate) ``repeats`` times and keep the best rate."""
    return max(fn() for _ in range(max(1, repeats)))


class Stopwatch:
    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
