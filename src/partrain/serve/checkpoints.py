"""A ``partrain train`` checkpoint as ``partrain serve`` rebuilds it: the model its spec names,
with the checkpoint's weights mapped from the file, and the spec's preprocessing.

The model is built on the meta device (no memory, no random initialisation) and takes the
checkpoint's tensors as ``torch.load(mmap=True)`` maps them, so a served model is held
once. A part of it (a stage of ``--stages``) can be given only its own weights
(`materialize`), so that no process holds more than its part.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import UsageError


class Preprocess(nn.Module):
    """``model(x * scale + offset)``: a model that takes raw inputs (``model_spec["preprocess"]``).

    The training data was scaled before the model saw it (the built-in digits:
    pixels 0..16, then ``x / 16`` and ``(x - 0.3) / 0.4``, i.e. ``x / 6.4 - 0.75``).
    Wrapping the model puts that step in the served model, so clients send what
    they have (raw pixels) and batching, shapes and metadata work as for any
    module. Every floating-point input is scaled; other inputs pass unchanged.
    """

    def __init__(self, model: nn.Module, scale: float, offset: float):
        super().__init__()
        self.model = model
        self.scale = float(scale)
        self.offset = float(offset)

    def forward(self, *inputs: torch.Tensor) -> Any:
        scaled = (x * self.scale + self.offset if x.is_floating_point() else x for x in inputs)
        return self.model(*scaled)

    def extra_repr(self) -> str:
        return f"scale={self.scale:g}, offset={self.offset:g}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def preprocess_of(spec: dict[str, Any], source: str) -> dict[str, Any] | None:
    """The checked ``model_spec["preprocess"]`` (``scale``, ``offset``, ``raw``), or None."""
    pre = spec.get("preprocess")
    if pre is None:
        return None
    if not (isinstance(pre, dict) and _number(pre.get("scale")) and _number(pre.get("offset"))
            and isinstance(pre.get("raw", ""), str)):
        raise UsageError(f"Expected the model spec's preprocess in {source!r} as {{'scale': number, "
                         f"'offset': number, 'raw': text}}. Received: {str(pre)[:200]}")
    return {"scale": float(pre["scale"]), "offset": float(pre["offset"]), "raw": pre.get("raw", "")}


def spec_parameters(spec: dict[str, Any], source: str) -> dict[str, Any]:
    """What a checkpoint's spec adds to the model metadata's ``parameters``: preprocess, task."""
    out: dict[str, Any] = {}
    pre = preprocess_of(spec, source)
    if pre is not None:
        out["preprocess"] = pre
    if isinstance(spec.get("task"), str):
        out["task"] = spec["task"]
    return out


def model_from_checkpoint(path: str, weights: bool = True) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the model a ``partrain train`` checkpoint (a file, or a sharded checkpoint's
    directory: ``checkpoint.dcp``) describes, in eval mode, and its spec.

    The spec names a built-in model or ``module:function`` (imported from the
    current directory or the spec's ``path``); its weights must fit (`fit_weights`);
    a ``preprocess`` entry wraps the model in `Preprocess`.

    The model is built on the meta device (no memory, no random initialisation) and
    takes the checkpoint's tensors as they map the file: the weights are read once, on
    first use, and held once. ``weights=False`` leaves them out: the caller keeps a part
    of the model and calls `materialize` on it (a stage of ``--stages``), so that no
    process holds more of the model than its part. A model that cannot be built on the
    meta device (its construction reads tensor values, or it keeps buffers outside its
    state dict) is built as before, with its weights.
    """
    from ..checkpoint import fit_weights, load_checkpoint
    from ..models import build_model, resolve_callable
    from ..sharded_checkpoint import consolidate

    state = consolidate(load_checkpoint(path, mmap=True))  # a sharded one (fsdp's, tp's): read whole here
    spec = state.get("model_spec")
    if not spec:
        raise UsageError(f"Expected a model spec in checkpoint {path!r} to rebuild its model. Received: none "
                         "(pass model_spec= to fit, or serve a module:factory that loads the weights)")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise UsageError(f"Expected the model spec of {path!r} to name a model. Received: {str(spec)[:200]}")
    name, kwargs = spec["name"], spec.get("kwargs") or {}
    path_entry = spec.get("path")
    if path_entry is not None and not isinstance(path_entry, str):
        raise UsageError(f"Expected the model spec's path in {path!r} as a directory. Received: {path_entry!r}")
    if ":" in name:
        resolve_callable(name, "model factory", path_entry)
    label = f"model {name!r} built from its spec"
    model = _on_meta(lambda: build_model(name, **kwargs))
    if model is None:  # built for real: its weights go in now, whatever the caller keeps
        model = build_model(name, **kwargs)
        fit_weights(model, state.get("model"), label)
    elif weights:
        fit_weights(model, state.get("model"), label, assign=True)
    model.eval()
    pre = preprocess_of(spec, path)
    if pre is not None:
        model = Preprocess(model, pre["scale"], pre["offset"]).eval()
    return model, spec


def _on_meta(build: Callable[[], nn.Module]) -> nn.Module | None:
    """``build()`` on the meta device, or None when the model cannot be rebuilt from its state
    dict alone there (its construction failed on meta tensors, or it holds buffers the state
    dict leaves out: they would stay meta)."""
    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # noqa: BLE001 - a construction that needs real values: build it for real
        return None
    if any(m._non_persistent_buffers_set for m in model.modules()):
        return None
    return model


def materialize(module: nn.Module, path: str) -> nn.Module:
    """Give ``module`` (a part of the model `model_from_checkpoint` built with ``weights=False``)
    its weights from the checkpoint at ``path``: only its own tensors are read. A module with
    no meta tensors is returned as it is."""
    from ..checkpoint import fit_weights, load_checkpoint

    tensors = [*module.parameters(), *module.buffers()]
    if not any(t.is_meta for t in tensors):
        return module
    own = module.state_dict(keep_vars=True)
    weights = load_checkpoint(path, mmap=True).get("model")
    if not isinstance(weights, dict):
        raise UsageError(f"Expected the checkpoint's 'model' entry to be a state dict in {path!r}. "
                         f"Received: {type(weights).__name__}")
    fit_weights(module, {k: v for k, v in weights.items() if k in own}, f"a part of the model in {path!r}",
                assign=True)
    return module.eval()
