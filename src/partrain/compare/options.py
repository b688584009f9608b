"""The what-if options of ``partrain compare``, parsed from text: budget, straggler, bandwidth, links, memory.

Each parser takes what a person types (``60s``, ``worker=1,slowdown=2``, ``1Gbit``) and
returns a number or a small frozen dataclass; bad text is one `UsageError` line saying what
was expected and what was received.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import UsageError

#: bits per second of each unit a bandwidth may be written in
_BANDWIDTH_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
                    "b": 8.0, "kb": 8e3, "mb": 8e6, "gb": 8e9, "tb": 8e12}
_SECONDS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
#: bytes of each unit a memory size may be written in
_MEMORY_UNITS = {"": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2.0**10, "mib": 2.0**20,
                 "gib": 2.0**30, "tib": 2.0**40}


@dataclass(frozen=True)
class Straggler:
    """Worker ``worker`` (its index among the workers) runs ``slowdown`` times slower: before each
    training step it sleeps ``slowdown - 1`` times the whole of its previous step (data, compute,
    optimizer and communication, its own delay left out), as a slower machine would take
    (`partrain.compare.probe`)."""

    worker: int = 1
    slowdown: float = 2.0

    def text(self) -> str:
        return f"worker={self.worker},slowdown={self.slowdown:g}"


def parse_budget(value: str | float | int) -> float:
    """``60s``, ``2m``, ``90`` (seconds) -> seconds."""
    return _quantity(value, r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h)?\s*", _SECONDS, "",
                     "a positive time budget such as 60s or 2m")


def parse_straggler(value: str | Straggler | None) -> Straggler | None:
    """``worker=1,slowdown=2`` -> `Straggler` (either key may be left out: worker 1, slowdown 2)."""
    if value is None or isinstance(value, Straggler):
        return value
    fields: dict[str, str] = {}
    for part in str(value).split(","):
        key, sep, raw = part.partition("=")
        if not sep or key.strip() not in ("worker", "slowdown") or key.strip() in fields:
            raise UsageError(f"Expected --straggler as worker=INDEX,slowdown=FACTOR. Received: {value!r}")
        fields[key.strip()] = raw.strip()
    try:
        worker = int(fields.get("worker", "1"))
        slowdown = float(fields.get("slowdown", "2"))
    except ValueError:
        raise UsageError(f"Expected --straggler as worker=INDEX,slowdown=FACTOR. Received: {value!r}") from None
    if worker < 0 or not (math.isfinite(slowdown) and slowdown >= 1):
        raise UsageError(f"Expected a straggler worker >= 0 and a slowdown >= 1. Received: {value!r}")
    return Straggler(worker, slowdown)


def parse_bandwidth(value: str | float | None) -> float | None:
    """``1Gbit``, ``100Mbit``, ``10GB`` (bytes), a bare number (bits/s) -> bytes per second."""
    if value is None:
        return None
    # b is a byte, bit a bit: 1GB is 8 Gbit
    bits = _quantity(value, r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?(?:bit|b))?(?:/s|ps)?\s*", _BANDWIDTH_UNITS,
                     "bit", "a positive bandwidth such as 1Gbit, 100Mbit or 10GB")
    return bits / 8.0


def parse_memory(value: str | float | None) -> float | None:
    """``4GB``, ``512MiB``, a bare number (bytes) -> bytes (None: none given)."""
    if value is None:
        return None
    return _quantity(value, r"\s*([0-9]*\.?[0-9]+)\s*((?:[kmgt]i?)?b)?\s*", _MEMORY_UNITS, "",
                     "a positive memory size such as 4GB or 512MiB")


def _quantity(value: str | float, pattern: str, units: dict[str, float], default_unit: str, expected: str) -> float:
    """A bare number, or a number and a unit (``pattern``'s two groups, case-insensitive) times the
    unit's factor in ``units``; one line unless the result is positive and finite."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        amount = float(value)
    else:
        found = re.fullmatch(pattern, str(value), re.IGNORECASE)
        amount = float(found.group(1)) * units[(found.group(2) or default_unit).lower()] if found else math.nan
    if not (math.isfinite(amount) and amount > 0):
        raise UsageError(f"Expected {expected}. Received: {value!r}")
    return amount


def parse_links(value: str | list[float]) -> list[float]:
    """``10Gbit,100Gbit`` -> bandwidths in bytes per second (for the scaling prediction)."""
    items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
    links = [parse_bandwidth(v) for v in items]
    if not links:
        raise UsageError(f"Expected one or more link speeds such as 10Gbit,100Gbit. Received: {value!r}")
    return [b for b in links if b is not None]


def bandwidth_text(bytes_per_s: float) -> str:
    """Bytes per second as the unit a person would write: ``1 Gbit/s``."""
    bits = bytes_per_s * 8
    for unit, size in (("Tbit", 1e12), ("Gbit", 1e9), ("Mbit", 1e6), ("kbit", 1e3)):
        if bits >= size:
            return f"{bits / size:g} {unit}/s"
    return f"{bits:g} bit/s"
