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

An ``Embedding`` also bounds the values: indices in ``[0, num_embeddings)``
(`InferredInput.value_range`); the server refuses others with a 400 instead of
letting the model fail on a batch that holds other callers' requests too. A
dynamic dim may have a largest size (*bound*: a language model's context, the
longest sequence it was trained on); `probe` tries sizes up to it only.

`pads_right_exactly` decides whether requests of different lengths may share a
batch padded at the end (the batcher's ``pad``): only when the model's answers
for a sequence, padded in a batch with a longer one, equal its answers alone.
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
    #: integer inputs that index a table: the values it has rows for, [low, high); None: any
    value_range: tuple[int, int] | None = None


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
        rows = int(layer.num_embeddings)
        return InferredInput((DYNAMIC,), torch.int64, f"{kind}(num_embeddings={rows})", (0, rows))
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
         rows: int = 2) -> list[Tensor]:
    """``fn`` on an example batch of ``rows`` rows of each (concrete) sample shape."""
    # integers are ones (a valid index of any vocabulary of two or more; a sequence's length of
    # one, which an LSTM's packing takes and zero is not); other inputs zeros
    example = tuple((torch.zeros if t.is_floating_point or t == torch.bool else torch.ones)((rows, *s), dtype=t)
                    for s, t in zip(shapes, dtypes))
    with torch.inference_mode():
        out = fn(example if len(example) > 1 else example[0])
    return _outputs(out, rows)


def _outputs(out: Any, rows: int) -> list[Tensor]:
    outs = [out] if isinstance(out, Tensor) else list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or not all(isinstance(o, Tensor) and o.dim() >= 1 and o.shape[0] == rows for o in outs):
        raise ValueError(
            "Expected the model to return a Tensor (or tuple of Tensors) with the batch in dim 0. "
            f"Received: {[tuple(o.shape) if isinstance(o, Tensor) else type(o).__name__ for o in outs]}"
        )
    return outs


def _bounded_sizes(bound: int) -> list[int]:
    """Sizes tried for a dim of at most ``bound``: the bound itself first (it must work), then smaller."""
    return list(dict.fromkeys((bound, max(1, bound // 2), 1)))


def _examples(shapes: Sequence[tuple[int, ...]],
              bounds: Sequence[tuple[int, ...] | None]) -> list[list[tuple[int, ...]]]:
    """The concrete sample shapes of each example run, distinct, in the order they are tried.

    Run ``k`` gives an unbounded dynamic dim ``PROBE_SIZES[k]`` (skipping sizes that would
    make a row huge) and a bounded one the ``k``-th of `_bounded_sizes` (its last, past the end).
    """
    def concrete(k: int, size: int) -> list[tuple[int, ...]]:
        out = []
        for s, b in zip(shapes, bounds):
            dims = []
            for d, n in enumerate(s):
                limit = DYNAMIC if b is None else b[d]
                if n != DYNAMIC:
                    dims.append(n)
                elif limit == DYNAMIC:
                    dims.append(size)
                else:
                    sizes = _bounded_sizes(limit)
                    dims.append(sizes[min(k, len(sizes) - 1)])
            out.append(tuple(dims))
        return out

    sizes = [n for n in PROBE_SIZES
             if all(_elements(s, n) <= PROBE_MAX_ELEMENTS for s in shapes)] or [PROBE_SIZES[0]]
    runs: list[list[tuple[int, ...]]] = []
    for k, n in enumerate(sizes):
        run = concrete(k, n)
        if run not in runs:
            runs.append(run)
    return runs


def probe(fn: Callable[[Any], Any], shapes: Sequence[tuple[int, ...]],
          dtypes: Sequence[torch.dtype], bounds: Sequence[tuple[int, ...] | None] | None = None) -> Described:
    """Run ``fn`` on zeros (ones for integers; 2 rows) to learn its outputs; dynamic input dims are tried at `PROBE_SIZES`.

    ``bounds`` (per input, None for none) gives a dynamic dim's largest size (``-1``: no
    bound, and for the other dims); such a dim is tried at its bound, then at smaller sizes.
    Without dynamic dims: one run. With them: runs at increasing sizes until two
    succeed; output dims that differ between the two become dynamic. If only one
    size works, the dynamic input dims are fixed to it. Raises `ValueError` (one
    line) when no example runs.
    """
    shapes = [tuple(s) for s in shapes]
    limits = list(bounds) if bounds is not None else [None] * len(shapes)
    if not any(DYNAMIC in s for s in shapes):
        outs = _run(fn, shapes, dtypes)
        return Described(shapes, [((*o.shape[1:],), o.dtype) for o in outs])
    examples = _examples(shapes, limits)
    runs: list[tuple[list[tuple[int, ...]], list[Tensor]]] = []
    error: BaseException | None = None
    for example in examples:
        try:
            runs.append((example, _run(fn, example, dtypes)))
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            error = exc
            continue
        if len(runs) == 2:
            break
    if not runs:
        assert error is not None
        tried = "; ".join(", ".join(str(list(s)) for s in example) for example in examples)
        raise ValueError(f"every example failed, with sample shapes {tried} (last: {error_line(error)})")
    if len(runs) == 1:
        fixed, outs = runs[0]
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


def pads_right_exactly(fn: Callable[[Any], Any], dtype: torch.dtype, value_range: tuple[int, int],
                       longest: int, pad_value: float) -> bool:
    """Whether a sequence of indices, padded at its end with ``pad_value`` in a batch with a
    longer one, gets its own answers back: the condition for the batcher's ``pad``.

    ``fn`` takes one input, ``[rows, time]`` indices in ``value_range``, of at most
    ``longest`` steps. Checked by running it, as `probe` checks shapes: random indices
    of ``longest // 2`` steps alone, then padded beside ``longest`` of them; each output
    must keep the time in dim 1 (where the batcher cuts a padded answer back) and the
    padded row's first steps must equal the answer alone. A causal model (a GPT, a
    one-way RNN) or one that reads each step alone passes; one that reads the whole
    sequence (a bidirectional encoder, pooling over time) does not, and serves
    requests of different lengths in separate batches.
    """
    short = longest // 2
    if short < 1:
        return False  # every request has the one length: nothing would be padded
    from ..data.padding import pad_cat

    g = torch.Generator().manual_seed(0)
    low, high = value_range
    a = torch.randint(low, high, (1, short), generator=g, dtype=dtype)
    b = torch.randint(low, high, (1, longest), generator=g, dtype=dtype)
    try:
        with torch.inference_mode():
            alone = _outputs(fn(a), 1)
            together = _outputs(fn(pad_cat([a, b], pad_value)), 2)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return False
    for own, batched in zip(alone, together):
        if own.dim() < 2 or own.shape[1] != short or batched.shape[1] != longest:
            return False
        mine = batched[:1, :short]
        if own.dtype.is_floating_point:
            scale = float(own.abs().max()) if own.numel() else 0.0
            # batched kernels differ in the last bits; a model that reads ahead differs by far more
            if not torch.allclose(mine, own, rtol=1e-4, atol=1e-5 * max(1.0, scale)):
                return False
        elif not torch.equal(mine, own):
            return False
    return len(alone) == len(together)


def _elements(shape: tuple[int, ...], size: int) -> int:
    total = 1
    for d in shape:
        total *= size if d == DYNAMIC else d
    return total
