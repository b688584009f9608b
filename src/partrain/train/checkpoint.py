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
- ``"epoch"``: epochs completed, ``"step"``: optimizer steps taken
- ``"config"``: the run's settings (JSON-able), ``"metrics"``: history so far
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch import nn

from ..errors import UsageError

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


def load_checkpoint(path: str) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``: no code is unpickled."""
    if not os.path.exists(path):
        raise UsageError(f"Expected an existing checkpoint file. Received: {path!r} (no such file)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UsageError(f"Expected {path!r} to be a partrain checkpoint. Received: {type(exc).__name__}: {first}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise UsageError(f"Expected a partrain checkpoint (format {FORMAT!r}) in {path!r}. Received something else")
    return state


def load_model(path: str) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model a checkpoint describes (built-in name or ``module:function``).

    Returns the model in eval mode and the checkpoint's ``model_spec``.
    """
    from ..models import build_model

    state = load_checkpoint(path)
    spec = state.get("model_spec")
    if not spec:
        raise UsageError(f"Checkpoint {path!r} has no model_spec: it came from Python code; rebuild the model yourself")
    model = build_model(spec["name"], _path=spec.get("path"), **spec.get("kwargs", {}))
    model.load_state_dict(state["model"])
    model.eval()
    return model, spec
