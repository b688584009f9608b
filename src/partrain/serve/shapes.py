"""Input shapes a model's first layer determines, and the example runs that describe its outputs.

Vocabulary: a *sample shape* is one request row's shape, without the batch dim;
``-1`` in it is a *dynamic* dim (any size, as the protocol's metadata writes it).

`infer_input` reads the first layer with parameters, in registration order
through ``Sequential`` and other containers (``nn.Module.modules()``):

=========================================  ==========================  ==========
first parameterised layer                  sample shape                datatype
=========================================  ==========================  ==========
``Linear(in_features=F)``                  ``[F]``                     its weight's
``Conv1d/2d/3d``, ``ConvTranspose1d/2d/3d``  ``[C, -1, ...]`` (C =      its weight's
                                           ``in_channels``, spatial
                                           dims dynamic)
``Embedding``, ``EmbeddingBag``            ``[-1]`` (a sequence of     INT64
                                           indices of any length)
=========================================  ==========================  ==========

Registration order is a guess at the order of ``forward``; `probe` checks the
guess by running the model on zeros, so a wrong guess becomes a clear request
for ``--input-shape``, never a server that fails on every request.
TorchScript modules are read the same way (by their ``original_name``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import error_line

DYNAMIC = -1

# Sizes tried for dynamic dims, smallest first. A dim a model accepts at two of them is
# served as dynamic; accepted at only one, it is fixed to that size (e.g. Conv2d ->
# Flatten -> Linear, which fits one image size only).
PROBE_SIZES = (32, 48, 64, 224)
PROBE_MAX_ELEMENTS = 1 << 22  # per example row: skip sizes that would make a 3-d probe huge

_SPATIAL = {"Conv1d": 1, "Conv2d": 2, "Conv3d": 3, "ConvTranspose1d": 1, "ConvTranspose2d": 2,
            "ConvTranspose3d": 3}
_CLASSES: list[tuple[type[nn.Module], str]] = [
    (nn.Linear, "Linear"), (nn.Embedding, "Embedding"), (nn.EmbeddingBag, "EmbeddingBag"),
    (nn.Conv1d, "Conv1d"), (nn.Conv2d, "Conv2d"), (nn.Conv3d, "Conv3d"),
    (nn.ConvTranspose1d, "ConvTranspose1d"), (nn.ConvTranspose2d, "ConvTranspose2d"),
    (nn.ConvTranspose3d, "ConvTranspose3d"),
]


class ShapeNotInferred(ValueError):
    """The first layer does not determine the input; the message says why (one clause)."""


@dataclass(frozen=True)
class InferredInput:
    """One input's sample shape (``-1``: dynamic) and dtype, and the layer they were read from."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    layer: str  # e.g. "Linear(in_features=8)", for messages


def first_parameterised_layer(module: nn.Module) -> nn.Module | None:
    """The first submodule, in registration order, that holds parameters of its own."""
    for m in module.modules():
        if next(m.parameters(recurse=False), None) is not None:
            return m
    return None


def _kind(layer: nn.Module) -> str:
    if isinstance(layer, torch.jit.ScriptModule):
        return str(getattr(layer, "original_name", type(layer).__name__))
    for cls, name in _CLASSES:
        if isinstance(layer, cls):
            return name
    return type(layer).__name__


def infer_input(module: Any) -> InferredInput:
    """The sample shape and dtype ``module``'s first parameterised layer determines.

    Raises `ShapeNotInferred` when there is no such layer or it does not
    determine the input (an LSTM, a normalisation layer, a lazy layer, ...).
    """
    if not isinstance(module, nn.Module):
        raise ShapeNotInferred(f"it is a {type(module).__name__}, not an nn.Module with layers to read")
    layer = first_parameterised_layer(module)
    if layer is None:
        raise ShapeNotInferred("it has no layer with parameters")
    kind = _kind(layer)
    weight = getattr(layer, "weight", None)
    if isinstance(weight, nn.parameter.UninitializedParameter):
        raise ShapeNotInferred(f"its first layer, {kind}, is lazy (its input size is not known before a first call)")
    if kind == "Linear":
        return InferredInput((int(layer.in_features),), _float_dtype(weight), f"Linear(in_features={layer.in_features})")
    if kind in _SPATIAL:
        spatial = (DYNAMIC,) * _SPATIAL[kind]
        return InferredInput((int(layer.in_channels), *spatial), _float_dtype(weight),
                             f"{kind}(in_channels={layer.in_channels})")
    if kind in ("Embedding", "EmbeddingBag"):
        return InferredInput((DYNAMIC,), torch.int64, f"{kind}(num_embeddings={layer.num_embeddings})")
    raise ShapeNotInferred(f"its first parameterised layer, {kind}, does not determine the input shape")


def _float_dtype(weight: Any) -> torch.dtype:
    # a float64 (or float16) model takes inputs of its own dtype; quantized or odd weights: float32
    dtype = getattr(weight, "dtype", torch.float32)
    return dtype if dtype in (torch.float16, torch.float32, torch.float64) else torch.float32


# --------------------------------------------------------------------------- example runs


@dataclass(frozen=True)
class Described:
    """What example runs found: sample shapes of the inputs (dynamic dims kept or fixed), outputs."""

    inputs: list[tuple[int, ...]]
    outputs: list[tuple[tuple[int, ...], torch.dtype]]  # sample shape (-1: varies), dtype


def _run(fn: Callable[[Any], Any], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
         size: int, rows: int = 2) -> list[Tensor]:
    # integers are ones (a valid index of any vocabulary of two or more; a sequence's length of
    # one, which an LSTM's packing takes and zero is not); other inputs zeros
    example = tuple((torch.zeros if t.is_floating_point or t == torch.bool else torch.ones)(
                        (rows, *(size if d == DYNAMIC else d for d in s)), dtype=t)
                    for s, t in zip(shapes, dtypes))
    with torch.inference_mode():
        out = fn(example if len(example) > 1 else example[0])
    outs = [out] if isinstance(out, Tensor) else list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or not all(isinstance(o, Tensor) and o.dim() >= 1 and o.shape[0] == rows for o in outs):
        raise ValueError(
            "Expected the model to return a Tensor (or tuple of Tensors) with the batch in dim 0. "
            f"Received: {[tuple(o.shape) if isinstance(o, Tensor) else type(o).__name__ for o in outs]}"
        )
    return outs


def probe(fn: Callable[[Any], Any], shapes: Sequence[tuple[int, ...]],
          dtypes: Sequence[torch.dtype]) -> Described:
    """Run ``fn`` on zeros (ones for integers; 2 rows) to learn its outputs; dynamic input dims are tried at `PROBE_SIZES`.

    Without dynamic dims: one run. With them: runs at increasing sizes until two
    succeed; output dims that differ between the two become dynamic. If only one
    size works, the dynamic input dims are fixed to it. Raises `ValueError` (one
    line) when no example runs.
    """
    shapes = [tuple(s) for s in shapes]
    if not any(DYNAMIC in s for s in shapes):
        outs = _run(fn, shapes, dtypes, size=1)
        return Described(shapes, [((*o.shape[1:],), o.dtype) for o in outs])
    sizes = [n for n in PROBE_SIZES
             if all(_elements(s, n) <= PROBE_MAX_ELEMENTS for s in shapes)] or [PROBE_SIZES[0]]
    runs: list[tuple[int, list[Tensor]]] = []
    error: BaseException | None = None
    for n in sizes:
        try:
            runs.append((n, _run(fn, shapes, dtypes, size=n)))
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            error = exc
            continue
        if len(runs) == 2:
            break
    if not runs:
        assert error is not None
        tried = ", ".join(str(n) for n in sizes)
        raise ValueError(f"every example failed, with the dynamic dims at size {tried} (last: {error_line(error)})")
    if len(runs) == 1:
        n, outs = runs[0]
        fixed = [tuple(n if d == DYNAMIC else d for d in s) for s in shapes]
        return Described(fixed, [((*o.shape[1:],), o.dtype) for o in outs])
    (_, a), (_, b) = runs
    if len(a) != len(b):
        raise ValueError(f"the model returned {len(a)} outputs, then {len(b)}, for inputs of other sizes")
    outputs = []
    for x, y in zip(a, b):
        if x.dim() != y.dim():
            raise ValueError(f"the model's output rank changed with the input size: {tuple(x.shape)} vs {tuple(y.shape)}")
        dims = tuple(p if p == q else DYNAMIC for p, q in zip(x.shape[1:], y.shape[1:]))
        outputs.append((dims, x.dtype))
    return Described(shapes, outputs)


def _elements(shape: tuple[int, ...], size: int) -> int:
    total = 1
    for d in shape:
        total *= size if d == DYNAMIC else d
    return total
