"""Freeze slices of parameters: chosen elements keep their exact values under any optimizer.

``requires_grad=False`` freezes a whole tensor. Freezing *part* of one - the
kernel ``[:, :, 29, 13]`` of a convolution, some rows of an embedding - cannot
be done by zeroing gradients alone: SGD with weight decay, momentum that was
built before, Adam and AdamW all move parameters whose gradient is zero. So
`freeze` does two things, both vectorized (no Python loop over elements):

1. a gradient hook on the parameter zeroes the gradient of frozen elements as
   it is produced - before DDP all-reduces it, before gradient clipping and
   before any optimizer reads it - so frozen elements neither feed momentum
   nor count in gradient norms;
2. two process-wide optimizer hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``
   and ``..._post_hook``, installed on first use) take a snapshot of the frozen
   elements - and of their entries in the optimizer's per-element state
   (momentum, Adam moments) - before every ``optimizer.step()`` of any
   ``torch.optim.Optimizer``, and write it back right after. Frozen elements
   therefore come out of every step bit-for-bit unchanged, under every
   optimizer and every strategy, with nothing for the user to wire.

Semantics: "frozen" means *no optimizer step changes these elements*. Their
value is whatever the tensor holds before the step, so ``load_state_dict``,
DDP's initial broadcast from rank 0 or a manual edit under ``no_grad`` are all
respected. A checkpoint of the model therefore already holds the frozen
values; what a resumed run needs is the masks: `freeze_state_dict` /
`load_freeze_state_dict` (or calling `freeze` again in the model factory).

The freeze state lives in this process (a registry keyed by the parameter,
holding no reference to it), not on the tensor: pickling, ``deepcopy`` and
``state_dict`` of a model are unaffected.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..errors import UsageError

__all__ = ["freeze", "frozen_mask", "freeze_state_dict", "idx", "load_freeze_state_dict", "unfreeze"]


class _IndexMaker:
    """``idx[...]`` returns the index expression itself: ``freeze(w, idx[:, :, 29, 13])``."""

    def __getitem__(self, key: Any) -> Any:
        return key

    def __repr__(self) -> str:
        return "partrain.nn.idx"


idx = _IndexMaker()


@dataclass
class _Frozen:
    ref: weakref.ref  # the parameter (weak: freezing never keeps a parameter alive)
    mask: torch.Tensor  # bool, the parameter's shape and device; True = frozen
    handle: Any = field(default=None)  # the gradient hook's RemovableHandle


# id(param) -> its freeze state; entries leave when the parameter is garbage-collected
_REGISTRY: dict[int, _Frozen] = {}
# bumped on every change, so that each optimizer's cached list of frozen parameters is rebuilt
_generation = 0
_hooks_installed = False


def freeze(param: torch.Tensor, index: Any) -> torch.Tensor:
    """Freeze the elements of ``param`` selected by ``index``; returns the parameter's whole mask.

    Args:
        param: a leaf tensor, usually an ``nn.Parameter``.
        index: a boolean mask of ``param``'s shape (True = frozen), or any index
            expression PyTorch accepts, most readably written with `idx`:
            ``freeze(conv.weight, idx[:, :, 29, 13])``. Freezing again adds to
            the frozen set.

    From now on every ``optimizer.step()`` of any ``torch.optim.Optimizer``
    leaves the frozen elements bit-for-bit as they were before the step, and
    their gradients are zero.
    """
    global _generation
    _check_param(param)
    mask = _as_mask(param, index)
    entry = _lookup(param)
    if entry is None:
        key = id(param)
        entry = _Frozen(weakref.ref(param, lambda _ref, key=key: _REGISTRY.pop(key, None)), mask.clone())
        if param.requires_grad:
            entry.handle = param.register_hook(functools.partial(_zero_frozen_grad, entry))
        _REGISTRY[key] = entry
        _install_optimizer_hooks()
    else:
        entry.mask |= mask
    _generation += 1
    return entry.mask.clone()


def unfreeze(param: torch.Tensor, index: Any = None) -> None:
    """Undo `freeze`: all of ``param`` (``index=None``) or the elements ``index`` selects.

    Unfreezing an element that is not frozen does nothing.
    """
    global _generation
    _check_param(param)
    entry = _lookup(param)
    if entry is None:
        return
    if index is not None:
        entry.mask &= ~_as_mask(param, index)
    if index is None or not bool(entry.mask.any()):
        if entry.handle is not None:
            entry.handle.remove()
        _REGISTRY.pop(id(param), None)
    _generation += 1


def frozen_mask(param: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``param``'s frozen mask, or None when none of it is frozen."""
    entry = _lookup(param)
    return None if entry is None else entry.mask.clone()


def freeze_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen masks of ``model``'s parameters, by parameter name (CPU bool tensors).

    Plain tensors: they go into a checkpoint and load back with ``weights_only=True``.
    Pass the unwrapped model (not a DDP wrapper) so the names match on resume.
    """
    out = {}
    for name, param in model.named_parameters():
        entry = _lookup(param)
        if entry is not None:
            out[name] = entry.mask.detach().cpu().clone()
    return out


def load_freeze_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Make ``model``'s frozen elements exactly those of ``state`` (from `freeze_state_dict`).

    Parameters not named in ``state`` are unfrozen. With ``strict``, a name that
    is not a parameter of ``model`` is an error.
    """
    params = dict(model.named_parameters())
    unknown = sorted(set(state) - set(params))
    if strict and unknown:
        raise UsageError(f"Expected freeze state for parameters of the model. Received unknown names: {unknown}")
    for name, param in params.items():
        unfreeze(param)
        if name in state:
            mask = state[name]
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != param.shape:
                raise UsageError(f"Expected a boolean mask of shape {tuple(param.shape)} for {name!r}. "
                                 f"Received: {_describe(mask)}")
            freeze(param, mask)


# ----- internals ------------------------------------------------------------------------------

def _check_param(param: Any) -> None:
    if not isinstance(param, torch.Tensor):
        raise UsageError(f"Expected a parameter tensor. Received: {type(param).__name__}")
    if not param.is_leaf:
        raise UsageError("Expected a leaf tensor (a parameter an optimizer updates). "
                         "Received: a tensor computed from others")


def _lookup(param: torch.Tensor) -> _Frozen | None:
    entry = _REGISTRY.get(id(param))
    if entry is not None and entry.ref() is param:
        return entry
    return None


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return repr(x)


def _as_mask(param: torch.Tensor, index: Any) -> torch.Tensor:
    """A boolean tensor of ``param``'s shape and device from a mask or an index expression."""
    if type(index).__module__ == "numpy":
        index = torch.as_tensor(index)
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.shape == param.shape:
        return index.to(param.device)
    mask = torch.zeros(param.shape, dtype=torch.bool, device=param.device)
    try:
        mask[index] = True
    except (IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise UsageError(
            f"Expected a boolean mask of shape {tuple(param.shape)} or an index into it "
            f"(e.g. idx[:, :, 2, 1]). Received: {_describe(index)} ({str(exc).splitlines()[0]})"
        ) from None
    return mask


def _zero_frozen_grad(entry: _Frozen, grad: torch.Tensor) -> torch.Tensor:
    if grad.is_sparse or grad.shape != entry.mask.shape:
        return grad  # sparse gradients pass unchanged; the step hooks still keep values exact
    return grad.masked_fill(entry.mask, 0)


def _install_optimizer_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _hooks_installed = True


def _frozen_params(optimizer: Optimizer) -> list[tuple[torch.Tensor, _Frozen]]:
    """The frozen parameters ``optimizer`` holds (cached until something changes)."""
    signature = (_generation, tuple(len(g["params"]) for g in optimizer.param_groups))
    cached = optimizer.__dict__.get("_partrain_frozen")
    if cached is not None and cached[0] == signature:
        return cached[1]
    found = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _lookup(p)
            if entry is not None:
                found.append((p, entry))
    optimizer.__dict__["_partrain_frozen"] = (signature, found)
    return found


def _before_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    if not _REGISTRY:
        return
    snapshot = []
    with torch.no_grad():
        for p, entry in _frozen_params(optimizer):
            mask = entry.mask
            state = optimizer.state.get(p, {})
            # per-element optimizer state (momentum, Adam moments): held still with the values
            held = [(k, v.masked_select(mask)) for k, v in state.items()
                    if isinstance(v, torch.Tensor) and k != "step" and v.shape == p.shape]
            snapshot.append((p, mask, p.detach().masked_select(mask), held))
    optimizer.__dict__["_partrain_frozen_snapshot"] = snapshot


def _after_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    snapshot = optimizer.__dict__.pop("_partrain_frozen_snapshot", None)
    if not snapshot:
        return
    with torch.no_grad():
        for p, mask, values, held in snapshot:
            p.detach().masked_scatter_(mask, values)
            state = optimizer.state.get(p, {})
            for k, v in held:
                if k in state and state[k].shape == p.shape:
                    state[k].masked_scatter_(mask, v)
