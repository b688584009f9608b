"""Freeze slices of parameters: chosen elements keep their exact values through optimizer steps.

``requires_grad=False`` freezes a whole tensor. Freezing *part* of one - the
kernel ``[:, :, 29, 13]`` of a convolution, some rows of an embedding - cannot
be done by zeroing gradients alone: SGD with weight decay, momentum that was
built before, Adam and AdamW all move parameters whose gradient is zero.

Two pieces, each belonging to the object it was applied to (nothing
process-wide, no registry):

1. `freeze(param, index)` records a boolean mask *on the parameter* (an
   attribute, so it travels wherever the parameter goes: pickling to a worker
   process, ``model.to(device)``, ``load_state_dict``) and adds a gradient hook
   that zeroes the frozen elements' gradient as it is produced - before DDP
   all-reduces it, before gradient clipping - so they neither feed momentum
   nor count in gradient norms.
2. `keep_frozen(optimizer)` attaches step hooks to *that* optimizer
   (``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``): before
   each ``step()`` they zero the frozen gradients (again: a parameter that came
   through pickling has lost its gradient hook - torch never pickles hooks) and
   take a snapshot of the frozen elements and of their entries in the
   optimizer's per-element state (momentum, Adam moments); right after the step
   they write it back. Both are vectorized (one masked copy per frozen tensor).
   Strategies call it in ``prepare`` for the optimizer they run; a hand-written
   loop without a strategy calls it once after building the optimizer.

Semantics: "frozen" means *no optimizer step changes these elements*. Their
value is whatever the tensor holds before the step, so ``load_state_dict``,
DDP's initial broadcast from rank 0 or a manual edit under ``no_grad`` are all
respected. Where other processes step the same memory at the same time
(``hogwild``), a pre-step snapshot could catch another process's step half
way: ``keep_frozen(optimizer).pin()`` makes the guard hold the values of one moment instead.

A checkpoint of the model already holds the frozen values; what a resumed run
needs is the masks: `freeze_state_dict` / `load_freeze_state_dict` (plain bool
tensors, loadable with ``weights_only=True``), or calling `freeze` again in the
model factory. ``copy.deepcopy`` of a ``Parameter`` drops its attributes (torch
builds a fresh one), so a deep copy is not frozen; ``state_dict()`` is unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ..errors import UsageError

__all__ = [
    "FrozenGuard",
    "freeze",
    "freeze_state_dict",
    "frozen_mask",
    "hold_frozen",
    "idx",
    "keep_frozen",
    "load_freeze_state_dict",
    "unfreeze",
]

_ON_PARAM = "_partrain_freeze"  # the attribute of a frozen parameter holding its `_FreezeState`
_ON_OPTIMIZER = "_partrain_frozen_guard"  # the attribute of an optimizer holding its `FrozenGuard`


class _IndexMaker:
    """``idx[...]`` returns the index expression itself: ``freeze(w, idx[:, :, 29, 13])``."""

    def __getitem__(self, key: Any) -> Any:
        return key

    def __repr__(self) -> str:
        return "partrain.nn.idx"


idx = _IndexMaker()


class _FreezeState:
    """What freezing records on a parameter: its mask, and this process's gradient hook."""

    __slots__ = ("grad_hook", "mask")

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask  # bool, the parameter's shape; True = frozen. Replaced, never edited in place
        self.grad_hook: Any = None  # RemovableHandle of the gradient hook, or None

    def __reduce__(self) -> tuple[Any, ...]:
        # the mask travels; the hook belongs to this process's autograd (torch never pickles hooks):
        # the copy gets its own from `keep_frozen` or the next `freeze`
        return (_FreezeState, (self.mask,))

    def mask_on(self, device: torch.device) -> torch.Tensor:
        """The mask on ``device`` (moved once when the parameter moved, e.g. ``model.to("cuda")``)."""
        if self.mask.device != device:
            self.mask = self.mask.to(device)
        return self.mask


# ----- recording masks on parameters ---------------------------------------------------------------

def freeze(param: torch.Tensor, index: Any) -> torch.Tensor:
    """Freeze the elements of ``param`` selected by ``index``; returns the parameter's whole mask.

    Args:
        param: a leaf tensor, usually an ``nn.Parameter``.
        index: a boolean mask of ``param``'s shape (True = frozen), or any index
            expression PyTorch accepts, most readably written with `idx`:
            ``freeze(conv.weight, idx[:, :, 29, 13])``. Freezing again adds to
            the frozen set.

    The mask is stored on the parameter; from now on its frozen gradients are
    zero, and every ``step()`` of an optimizer `keep_frozen` was attached to
    (every partrain strategy attaches it) leaves the frozen elements bit-for-bit
    as they were before the step.
    """
    _check_param(param)
    mask = _as_mask(param, index)
    state = _state(param)
    if state is None:
        state = _FreezeState(mask.clone())
        param.__dict__[_ON_PARAM] = state
    else:
        state.mask = state.mask_on(param.device) | mask  # a new tensor: a pinned guard sees the change
    _ensure_grad_hook(param, state)
    return state.mask.clone()


def unfreeze(param: torch.Tensor, index: Any = None) -> None:
    """Undo `freeze`: all of ``param`` (``index=None``) or the elements ``index`` selects.

    Unfreezing an element that is not frozen does nothing.
    """
    _check_param(param)
    state = _state(param)
    if state is None:
        return
    if index is not None:
        state.mask = state.mask_on(param.device) & ~_as_mask(param, index)
    if index is None or not bool(state.mask.any()):
        if state.grad_hook is not None:
            state.grad_hook.remove()
        del param.__dict__[_ON_PARAM]


def frozen_mask(param: torch.Tensor) -> torch.Tensor | None:
    """A copy of ``param``'s frozen mask, or None when none of it is frozen."""
    state = _state(param)
    return None if state is None else state.mask.clone()


def freeze_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen masks of ``model``'s parameters, by parameter name (CPU bool tensors).

    Plain tensors: they go into a checkpoint and load back with ``weights_only=True``.
    Pass the unwrapped model (not a DDP wrapper) so the names match on resume.
    """
    out = {}
    for name, param in model.named_parameters():
        state = _state(param)
        if state is not None:
            out[name] = state.mask.detach().cpu().clone()
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
    for name, mask in state.items():
        if name in params and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                               or mask.shape != params[name].shape):
            raise UsageError(f"Expected a boolean mask of shape {tuple(params[name].shape)} for {name!r}. "
                             f"Received: {_describe(mask)}")
    for name, param in params.items():
        unfreeze(param)
        if name in state:
            freeze(param, state[name])


# ----- keeping them exact through optimizer steps --------------------------------------------------

def keep_frozen(optimizer: Optimizer) -> FrozenGuard:
    """Attach freezing to ``optimizer``: its steps leave the frozen elements of its parameters exact.

    Idempotent: a second call returns the guard already attached. Parameters
    frozen later (or unfrozen) are seen at the next step. Also gives frozen
    parameters that arrived without one (by pickling) their gradient hook.
    Returns the `FrozenGuard`; ``guard.remove()`` detaches it.
    """
    if not isinstance(optimizer, Optimizer):
        raise UsageError(f"Expected a torch.optim.Optimizer. Received: {type(optimizer).__name__}")
    guard = optimizer.__dict__.get(_ON_OPTIMIZER)
    if guard is None:
        guard = FrozenGuard(optimizer)
        optimizer.__dict__[_ON_OPTIMIZER] = guard
    for param, state in _frozen_params(optimizer):
        _ensure_grad_hook(param, state)
    return guard


@dataclass
class _Held:
    """The frozen elements of one parameter and of its per-element optimizer state, at one moment."""

    param: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor
    state: dict[str, torch.Tensor]


class FrozenGuard:
    """The step hooks `keep_frozen` attached to one optimizer (made by `keep_frozen`, not directly)."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]
        self._snapshot: list[_Held] = []
        self._pinned: list[_Held] | None = None

    def pin(self) -> None:
        """Hold the frozen elements (and their optimizer state) at their values *now*, not before each step.

        For memory that other processes step at the same time (``hogwild``): a
        snapshot taken before this process's step could catch another one's
        step half way and write its half-done values back. Call when no process
        is stepping (after set-up); call again after changing frozen values on
        purpose. A parameter frozen (or frozen further) later is pinned at its next step.
        """
        self._pinned = [_hold(self.optimizer, p, s.mask_on(p.device)) for p, s in _frozen_params(self.optimizer)]

    def remove(self) -> None:
        """Detach from the optimizer: its steps no longer keep frozen elements exact."""
        for handle in self._handles:
            handle.remove()
        self.optimizer.__dict__.pop(_ON_OPTIMIZER, None)

    def _before_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        frozen = _frozen_params(optimizer)
        if not frozen and not self._pinned:  # the usual step: nothing frozen, nothing held
            self._snapshot = []
            return
        with torch.no_grad():
            for p, state in frozen:
                _zero_frozen_grad_(p, state.mask_on(p.device))
            if self._pinned is None:
                self._snapshot = [_hold(optimizer, p, state.mask) for p, state in frozen]
            else:
                self._snapshot = self._pinned = self._pins_for(frozen)

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        snapshot, self._snapshot = self._snapshot, []
        if not snapshot:
            return
        with torch.no_grad():
            for held in snapshot:
                _restore(optimizer, held)

    def _pins_for(self, frozen: list[tuple[torch.Tensor, _FreezeState]]) -> list[_Held]:
        """The pinned entries of the parameters frozen now; a parameter with a new mask is pinned now."""
        assert self._pinned is not None
        out = []
        for p, state in frozen:
            held = next((h for h in self._pinned if h.param is p and h.mask is state.mask), None)
            out.append(held if held is not None else _hold(self.optimizer, p, state.mask))
        return out


@contextlib.contextmanager
def hold_frozen(params: Sequence[torch.Tensor], *aligned: Sequence[torch.Tensor]) -> Iterator[None]:
    """The frozen elements of ``params`` come out of the block as they went in.

    For code that changes parameters outside an optimizer step (local SGD's
    averaging, DiLoCo's outer step). ``aligned``: more lists of tensors of the
    same shapes as ``params`` (e.g. an outer optimizer's momentum), whose
    elements at the same positions are held too.
    """
    held = []
    with torch.no_grad():
        for i, p in enumerate(params):
            state = _state(p)
            if state is not None:
                mask = state.mask_on(p.device)
                held.append((mask, [(t, t.masked_select(mask)) for t in (p, *(a[i] for a in aligned))]))
    try:
        yield
    finally:
        with torch.no_grad():
            for mask, tensors in held:
                for t, values in tensors:
                    t.masked_scatter_(mask, values)


# ----- internals ------------------------------------------------------------------------------------

def _state(param: torch.Tensor) -> _FreezeState | None:
    return param.__dict__.get(_ON_PARAM) if isinstance(param, torch.Tensor) else None


def _frozen_params(optimizer: Optimizer) -> list[tuple[torch.Tensor, _FreezeState]]:
    """The frozen parameters ``optimizer`` holds (a dictionary look-up per parameter)."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = p.__dict__.get(_ON_PARAM)
            if state is not None:
                out.append((p, state))
    return out


def _check_param(param: Any) -> None:
    if not isinstance(param, torch.Tensor):
        raise UsageError(f"Expected a parameter tensor. Received: {type(param).__name__}")
    if not param.is_leaf:
        raise UsageError("Expected a leaf tensor (a parameter an optimizer updates). "
                         "Received: a tensor computed from others")


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


def _ensure_grad_hook(param: torch.Tensor, state: _FreezeState) -> None:
    if state.grad_hook is None and param.requires_grad:
        state.grad_hook = param.register_hook(_GradMask(state))


class _GradMask:
    """The gradient hook: reads the state's current mask, so later `freeze` calls apply."""

    def __init__(self, state: _FreezeState) -> None:
        self.state = state

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if grad.is_sparse or grad.shape != self.state.mask.shape:
            return grad  # sparse gradients pass unchanged; the step hooks still keep values exact
        return grad.masked_fill(self.state.mask_on(grad.device), 0)


def _zero_frozen_grad_(p: torch.Tensor, mask: torch.Tensor) -> None:
    grad = p.grad
    if grad is not None and not grad.is_sparse and grad.shape == mask.shape:
        grad.masked_fill_(mask, 0)


def _hold(optimizer: Optimizer, p: torch.Tensor, mask: torch.Tensor) -> _Held:
    # per-element optimizer state (momentum, Adam moments) is held with the values; "step" counts are not
    state = {k: v.masked_select(mask) for k, v in optimizer.state.get(p, {}).items()
             if isinstance(v, torch.Tensor) and k != "step" and v.shape == p.shape}
    return _Held(p, mask, p.detach().masked_select(mask), state)


def _restore(optimizer: Optimizer, held: _Held) -> None:
    held.param.detach().masked_scatter_(held.mask, held.values)
    state = optimizer.state.get(held.param, {})
    for k, values in held.state.items():
        v = state.get(k)
        if isinstance(v, torch.Tensor) and v.shape == held.param.shape:
            v.masked_scatter_(held.mask, values)
