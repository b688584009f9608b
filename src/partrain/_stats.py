"""Quantiles by the nearest-rank rule, one implementation for every figure partrain reports."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

import torch


def quantiles(values: array | Iterable[float], qs: Iterable[float]) -> list[float]:
    """The ``qs`` quantiles (0..1) of ``values`` by the nearest-rank rule (the ``ceil(q n)``-th
    smallest, at least the first), by selection rather than a sort; NaN for each when there are
    no values. A flat buffer of doubles (``array("d")``) is read without a copy."""
    flat_values = values if isinstance(values, array) and values.typecode == "d" else array("d", values)
    n = len(flat_values)
    if n == 0:
        return [math.nan for _ in qs]
    flat = torch.frombuffer(flat_values, dtype=torch.float64)
    return [float(flat.kthvalue(min(n, max(1, math.ceil(q * n)))).values) for q in qs]


def percentile(values: array | Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank rule; NaN for no values."""
    return quantiles(values, (q,))[0]
