"""The samples a load test sends: random ones shaped by the model's metadata, or rows of an .npz file.

A *sample* is one request's input, a dict ``{input name: array}`` whose arrays
carry a leading batch dimension (1 unless a shape says otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ...errors import UsageError
from ..protocol import DATATYPES, TensorSpec
from .target import ModelInfo


def concrete_shape(spec: TensorSpec, override: Sequence[int] | None = None) -> tuple[int, ...]:
    """The shape of one request's tensor: ``override`` if given, else the metadata's with -1 -> 1."""
    if override is not None:
        return tuple(override)
    return tuple(1 if d < 0 else d for d in spec.shape)


def random_inputs(info: ModelInfo, count: int, shape: Sequence[int] | None = None,
                  seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``count`` random samples for the model's inputs: normal floats, small integers, coin flips."""
    if shape is not None and len(info.inputs) != 1:
        raise UsageError(f"Expected --shape only for a model with one input. "
                         f"Received: model {info.name!r} with inputs {[t.name for t in info.inputs]}")
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(count):
        sample = {}
        for t in info.inputs:
            dims = concrete_shape(t, shape)
            dtype = DATATYPES[t.datatype][1]
            if dtype.kind == "f":
                a = rng.standard_normal(dims).astype(dtype)
            elif dtype.kind == "b":
                a = rng.random(dims) < 0.5
            else:
                a = rng.integers(0, 10, size=dims).astype(dtype)
            sample[t.name] = a
        samples.append(sample)
    return samples


def npz_inputs(path: str, info: ModelInfo, shape: Sequence[int] | None = None,
               limit: int | None = None) -> list[dict[str, np.ndarray]]:
    """Samples from an .npz file: one array per input name (or one array for a one-input model).

    Each row of the arrays (first dimension) is one request, sent with a batch
    dimension of 1 (or reshaped to ``shape``).
    """
    if not os.path.exists(path):
        raise UsageError(f"Expected an existing .npz file. Received: {path!r} (no such file)")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as exc:
        raise UsageError(f"Expected {path!r} to be an .npz archive. Received: {type(exc).__name__}: {exc}") from None
    names = [t.name for t in info.inputs]
    if all(n in arrays for n in names):
        chosen = {n: arrays[n] for n in names}
    elif len(names) == 1 and ("x" in arrays or len(arrays) == 1):
        chosen = {names[0]: arrays["x"] if "x" in arrays else next(iter(arrays.values()))}
    else:
        raise UsageError(f"Expected arrays named {names} in {path!r}. Received: {sorted(arrays)}")
    rows = {len(a) for a in chosen.values()}
    if len(rows) != 1 or 0 in rows or any(a.ndim == 0 for a in chosen.values()):
        raise UsageError(f"Expected arrays with the same positive number of rows in {path!r}. "
                         f"Received: { {k: list(a.shape) for k, a in chosen.items()} }")
    n = rows.pop() if limit is None else min(rows.pop(), limit)
    specs = {t.name: t for t in info.inputs}
    samples = []
    for i in range(n):
        sample = {}
        for name, a in chosen.items():
            row = np.ascontiguousarray(a[i], dtype=DATATYPES[specs[name].datatype][1])
            dims = tuple(shape) if shape is not None else (1, *row.shape)
            try:
                sample[name] = row.reshape(dims)
            except ValueError:
                raise UsageError(f"Expected rows of {path!r} to fit shape {list(dims)}. "
                                 f"Received: rows of shape {list(row.shape)}") from None
        samples.append(sample)
    return samples
