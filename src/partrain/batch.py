"""Batches as every layer sees them: tensors, tuples or dicts, nested.

`fit` trains on any batch structure:

- a pair ``(inputs, target)`` (a ``TensorDataset(x, y)``, a dataset yielding ``(x, y)``);
- a longer tuple ``(x1, ..., xk, target)``: the model is called as ``model(x1, ..., xk)``;
- a dict: the target is the entry under ``target_key`` (by default the first present of
  ``y``, ``target``, ``targets``, ``label``, ``labels``) and the model is called with the
  other entries as keyword arguments, ``model(**inputs)`` - or with the one value when
  there is only one other entry, ``model(x)``.

Strategies, the training loop, serving and data pipelines use these helpers; none of them
knows about losses or metrics (`partrain.train.task` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ._tree import map_tensors
from .errors import UsageError

TARGET_KEYS = ("y", "target", "targets", "label", "labels")
OUTPUT_KEYS = ("logits", "output", "outputs", "prediction", "predictions")


def split_batch(batch: Any, target_key: str | None = None) -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch (see the module docstring for the structures)."""
    if isinstance(batch, Mapping):
        key = target_key or next((k for k in TARGET_KEYS if k in batch), None)
        if key is None or key not in batch:
            want = repr(target_key) if target_key else f"one of {list(TARGET_KEYS)}"
            raise UsageError(f"Expected dict batches with a target under {want} (or Task(target_key=...)). "
                             f"Received keys: {sorted(map(str, batch))}")
        return {k: v for k, v in batch.items() if k != key}, batch[key]
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        inputs = batch[0] if len(batch) == 2 else tuple(batch[:-1])
        return inputs, batch[-1]
    raise UsageError("Expected batches as (inputs, target), (x1, ..., target) or a dict with a target key. "
                     f"Received: {describe(batch)}")


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a dict (``model(x)`` for a dict of one), ``model(*inputs)`` for a
    tuple, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        if len(inputs) == 1:
            return model(next(iter(inputs.values())))
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def to_device(obj: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Every tensor of a nested batch moved to ``device``."""
    return map_tensors(obj, lambda t: t.to(device, non_blocking=non_blocking))


def tensors_of(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor of a nested structure, in order."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, Mapping):
        return [t for k, v in obj.items() for t in tensors_of(v, f"{prefix}[{k!r}]")]
    if isinstance(obj, (tuple, list)):
        return [t for i, v in enumerate(obj) for t in tensors_of(v, f"{prefix}[{i}]")]
    return []


def batch_size(target: Any, inputs: Any = None) -> int:
    """Samples in a batch: the leading dimension of the target (or of the first input tensor)."""
    if type(target) is torch.Tensor and target.dim() > 0:  # the usual batch, asked several times a step
        return target.shape[0]
    for _, t in tensors_of(target) + tensors_of(inputs):
        if t.dim() > 0:
            return int(t.shape[0])
    raise UsageError(f"Expected a batch holding at least one tensor with a batch dimension. Received: {describe(target)}")


def describe(obj: Any) -> str:
    """A short description of a nested batch or output for error lines."""
    if isinstance(obj, torch.Tensor):
        return f"tensor {tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')}"
    if isinstance(obj, Mapping):
        return "dict {" + ", ".join(f"{k!r}: {describe(v)}" for k, v in list(obj.items())[:6]) + "}"
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__} of {len(obj)} (" + ", ".join(describe(v) for v in obj[:6]) + ")"
    return type(obj).__name__


def primary(output: Any) -> torch.Tensor:
    """The output a named loss or a built-in metric uses."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, Mapping):
        for key in OUTPUT_KEYS:
            if isinstance(output.get(key), torch.Tensor):
                return output[key]
    raise UsageError("Expected a model output that is a tensor, a tuple starting with one, or a dict with one of "
                     f"{list(OUTPUT_KEYS)} (or a loss_fn of your own). Received: {describe(output)}")
