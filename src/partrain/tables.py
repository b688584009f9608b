"""Plain-text tables for terminal output: the population report and the benchmarks print them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, numbers right-aligned, floats to 3 significant places, NaN as "-"."""
    text = [[format_number(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row, raw in zip(text, rows):
        parts = [c.rjust(w) if isinstance(v, (int, float)) else c.ljust(w) for c, w, v in zip(row, widths, raw)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def format_number(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        # 3 significant places, without an exponent: 999.6 rounds up to "1,000", not "1e+03"
        return f"{v:,.3g}" if abs(v) < 999.5 else f"{v:,.0f}"
    return str(v)
