"""Search spaces: where each member's hyperparameters are drawn from, and how PBT mutates them.

A space maps a hyperparameter name to one of:

- a `Distribution` (`loguniform`, `uniform`, `randint`, `choice`),
- a list or tuple of values (a categorical choice, as in Ray Tune),
- a callable with no argument returning a value (resampled by calling it).

All randomness comes from a ``torch.Generator`` so a run is reproducible from
its seed and the generator's state fits in a ``weights_only`` checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UsageError


def _uniform01(gen: torch.Generator) -> float:
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def _index(n: int, gen: torch.Generator) -> int:
    return int(torch.randint(n, (), generator=gen))


class Distribution:
    """A hyperparameter distribution: `sample` draws, `clip` keeps a perturbed value inside it."""

    def sample(self, gen: torch.Generator) -> float:
        raise NotImplementedError

    def clip(self, value: float) -> float:
        return value


@dataclass(frozen=True)
class uniform(Distribution):  # noqa: N801 - reads like Ray Tune's tune.uniform
    low: float
    high: float

    def sample(self, gen: torch.Generator) -> float:
        return self.low + (self.high - self.low) * _uniform01(gen)

    def clip(self, value: float) -> float:
        return min(max(value, self.low), self.high)


@dataclass(frozen=True)
class loguniform(Distribution):  # noqa: N801
    low: float
    high: float

    def sample(self, gen: torch.Generator) -> float:
        lo, hi = math.log(self.low), math.log(self.high)
        return math.exp(lo + (hi - lo) * _uniform01(gen))

    def clip(self, value: float) -> float:
        return min(max(value, self.low), self.high)


@dataclass(frozen=True)
class randint(Distribution):  # noqa: N801
    """Integers in ``[low, high]`` (both included)."""

    low: int
    high: int

    def sample(self, gen: torch.Generator) -> float:
        return float(self.low + _index(self.high - self.low + 1, gen))

    def clip(self, value: float) -> float:
        return float(min(max(round(value), self.low), self.high))


@dataclass(frozen=True)
class choice(Distribution):  # noqa: N801
    values: tuple[float, ...]

    def sample(self, gen: torch.Generator) -> float:
        return float(self.values[_index(len(self.values), gen)])


Spec = Distribution | Sequence[float] | Callable[[], float]


def sample(spec: Spec, gen: torch.Generator) -> float:
    """Draw one value from a space entry."""
    if isinstance(spec, Distribution):
        return spec.sample(gen)
    if isinstance(spec, (list, tuple)):
        return float(spec[_index(len(spec), gen)])
    if callable(spec):
        return float(spec())
    raise UsageError(f"Expected a distribution, a list of values or a callable. Received: {spec!r}")


def perturb(spec: Spec, value: float, factors: Sequence[float], gen: torch.Generator) -> float:
    """Ray Tune's perturbation: a categorical moves to a neighbouring value, a number is scaled."""
    values = spec.values if isinstance(spec, choice) else spec if isinstance(spec, (list, tuple)) else None
    if values is not None:
        values = [float(v) for v in values]
        if value not in values:
            return values[_index(len(values), gen)]
        i = values.index(value) + (-1 if _uniform01(gen) < 0.5 else 1)
        return values[min(max(i, 0), len(values) - 1)]
    new = value * float(factors[_index(len(factors), gen)])
    return spec.clip(new) if isinstance(spec, Distribution) else new


_KINDS = {"loguniform": 2, "uniform": 2, "randint": 2}


def parse_space_entry(text: str) -> tuple[str, Spec]:
    """Parse ``name=kind:args`` (the CLI's ``--space``).

    Kinds: ``loguniform:LOW:HIGH``, ``uniform:LOW:HIGH``, ``randint:LOW:HIGH``,
    ``choice:V1,V2,...`` and a plain number (a constant).
    """
    name, eq, rhs = text.partition("=")
    name = name.strip()
    if not eq or not name or not rhs:
        raise UsageError(f"Expected --space NAME=KIND:ARGS, e.g. lr=loguniform:1e-3:1e-1. Received: {text!r}")
    kind, _, args = rhs.partition(":")
    try:
        if kind == "choice":
            values = tuple(float(v) for v in args.split(","))
            if not values:
                raise ValueError
            return name, choice(values)
        if kind in _KINDS:
            parts = args.split(":")
            if len(parts) != 2:
                raise ValueError
            low, high = float(parts[0]), float(parts[1])
            if not low <= high or (kind == "loguniform" and low <= 0):
                raise ValueError
            if kind == "randint":
                return name, randint(int(low), int(high))
            return name, (loguniform if kind == "loguniform" else uniform)(low, high)
        return name, choice((float(rhs),))
    except ValueError:
        raise UsageError(
            f"Expected --space {name}=loguniform:LOW:HIGH (0 < LOW <= HIGH), uniform:LOW:HIGH, "
            f"randint:LOW:HIGH, choice:V1,V2,... or a number. Received: {text!r}"
        ) from None


def describe(spec: Any) -> str:
    """A short text for a space entry (for logs and the leaderboard header)."""
    if isinstance(spec, choice):
        return "choice:" + ",".join(f"{v:g}" for v in spec.values)
    if isinstance(spec, (uniform, loguniform, randint)):
        return f"{type(spec).__name__}:{spec.low:g}:{spec.high:g}"
    return repr(spec)
