"""Checkpoints: plain tensors and primitives, written atomically, read with ``weights_only=True``.

Format (a dict; every producer in partrain writes it, every consumer reads it):

- ``"format"``: ``"partrain/1"``
- ``"model"``: the model's ``state_dict()`` (unwrapped: no ``module.`` prefix)
- ``"model_spec"``: ``{"name": str, "kwargs": dict, "input_shape": list[int],
  "num_classes": int, "task": str, "path": str, "preprocess": {"scale", "offset", "raw"}}``
  (only ``name`` and ``kwargs`` are required; ``path`` is where a ``module:function`` factory
  of a user's script lives; ``preprocess`` maps raw inputs to the model's:
  ``x * scale + offset``), or ``None`` when the model's factory cannot be imported by name
- ``"task"``: the loss, metrics and precision it trained with (`Task.describe`)
- ``"optimizer"``, ``"strategy"``, ``"scheduler"``: state dicts or ``None``
- ``"optimizer_class"``: the optimizer's class as ``module.Name`` (a resume with another
  one starts its optimizer afresh)
- ``"epoch"``: epochs completed, ``"step"``: optimizer steps taken
- ``"config"``: the run's settings (JSON-able), ``"metrics"``: history so far

Strategies whose processes each hold part of the model (``fsdp``, ``tp``) write the same
content as a directory of shards instead (`partrain.sharded_checkpoint`: ``checkpoint.dcp``
next to ``checkpoint.pt``, one file per process, replaced as atomically); `load_checkpoint`
reads either form, `load_model` rebuilds the model from either, and the run's end or
``partrain export`` writes the one-file form of a sharded checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .errors import UsageError, error_line

FORMAT = "partrain/1"


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (a crash never leaves half a file)."""
    state = {"format": FORMAT, **state}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".ckpt-", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_checkpoint(path: str, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``: no code is unpickled.

    A sharded checkpoint (a directory, `partrain.sharded_checkpoint`) gives everything but its
    tensors: ``"model"`` holds tensors on the meta device (shapes and dtypes, enough for
    `fit_weights` to check a model), ``"optimizer"`` is None and ``"sharded_path"`` names the
    version read; `partrain.sharded_checkpoint.consolidate` reads the tensors.

    ``mmap``: the tensors map the file instead of being read into memory (a page is
    read when first touched): a process that uses part of the weights reads only that
    part, and weights used in place (`fit_weights` with ``assign``) are never copied.
    """
    if not os.path.exists(path):
        raise UsageError(f"Expected an existing checkpoint file. Received: {path!r} (no such file)")
    if os.path.isdir(path):
        from .sharded_checkpoint import read_state

        return read_state(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UsageError(f"Expected {path!r} to be a partrain checkpoint. Received: {type(exc).__name__}: {first}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"Expected a partrain checkpoint (format {FORMAT!r}) in {path!r}. Received something else")
    return state


def fit_weights(model: nn.Module, weights: Any, label: str, assign: bool = False) -> None:
    """``model.load_state_dict(weights)``, or one line naming the tensors that do not fit.

    ``assign``: the model takes the checkpoint's tensors themselves instead of copying
    them into its own (for a model built on the meta device, which has none). Weights on
    the meta device (a sharded checkpoint's shapes, from `load_checkpoint`), or a model
    there (the caller's check of a sharded run), are checked, not loaded.

    torch's own error lists every key over many lines (a one-line report shows the
    first, which says nothing useful); this names the count and the first few, with
    both shapes: ``8.weight: checkpoint (10, 128) vs model (5, 128)``.
    """
    if not isinstance(weights, Mapping):
        raise UsageError(f"Expected the checkpoint's 'model' entry to be a state dict for {label}. "
                         f"Received: {type(weights).__name__}")
    own = model.state_dict()

    def listed(items: list[str]) -> str:
        return "; ".join(items[:3]) + ("; ..." if len(items) > 3 else "")

    mismatched = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in weights.items()
                  if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape]
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} mismatched tensor{'s' * (len(mismatched) != 1)} "
                        f"({listed(mismatched)})")
    if missing:
        problems.append(f"{len(missing)} missing from the checkpoint ({listed(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} not in the model ({listed(unexpected)})")
    if problems:
        raise UsageError(f"Expected checkpoint weights to fit {label}. Received: " + ", ".join(problems))
    if any(isinstance(v, torch.Tensor) and v.is_meta for v in weights.values()) or \
            (not assign and any(v.is_meta for v in own.values())):
        return  # shapes without values on one side, and nothing to assign: checked, nothing to load
    try:
        model.load_state_dict(weights, assign=assign)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise UsageError(f"Expected checkpoint weights to fit {label}. Received: {error_line(exc)}") from None


def load_model(path: str) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model a checkpoint describes (built-in name or ``module:function``).

    Returns the model in eval mode and the checkpoint's ``model_spec``.
    """
    from .models import build_model
    from .sharded_checkpoint import consolidate

    state = consolidate(load_checkpoint(path))
    spec = state.get("model_spec")
    if not spec:
        raise UsageError(f"Checkpoint {path!r} has no model_spec: it came from Python code; rebuild the model yourself")
    model = build_model(spec["name"], _path=spec.get("path"), **spec.get("kwargs", {}))
    fit_weights(model, state["model"], f"model {spec['name']!r} built from its spec")
    model.eval()
    return model, spec
