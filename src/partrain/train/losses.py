"""The named losses and metrics of `partrain.train.task`, and what a model's own loss averages over.

Losses return one value per sample (summed over a sample's valid positions for token-level
ones); metrics likewise; `own_loss_units` says in what units a model's own mean loss was
taken. `Task` (``partrain.train.task``) puts them together.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..batch import primary
from ..errors import UsageError

CLASSIFICATION_LOSSES = ("cross_entropy", "nll", "bce", "causal_lm")
REGRESSION_LOSSES = ("mse", "l1", "smooth_l1", "huber")
#: the model computes the loss itself (its output's ``loss``)
OWN_LOSS = "own"
LOSSES = ("auto", OWN_LOSS, *CLASSIFICATION_LOSSES, *REGRESSION_LOSSES)
METRICS = ("accuracy", "mse", "mae", "token_accuracy", "perplexity")
#: metrics computed from the epoch's mean loss, not summed per batch
DERIVED_METRICS = ("perplexity",)
PRECISIONS = ("fp32", "bf16")
#: a target position that counts in no loss or metric (padding), as in ``F.cross_entropy``
IGNORE_INDEX = -100
#: the loss units of a task: samples, or the valid target positions (tokens, pixels)
SAMPLES, TOKENS = "samples", "tokens"

LossFn = Callable[[Any, Any], torch.Tensor]
MetricFn = Callable[[Any, Any], torch.Tensor]


# ----- losses ----------------------------------------------------------------------------
def _match(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and float target of equal shape for an elementwise loss ((N, 1) vs (N,) is fine)."""
    target = target.to(out.dtype if out.is_floating_point() else torch.float32)
    if out.shape != target.shape:
        if out.numel() != target.numel() or (out.dim() and target.dim() and out.shape[0] != target.shape[0]):
            raise UsageError(f"Expected a model output shaped like the target {tuple(target.shape)}. "
                             f"Received: output {tuple(out.shape)}")
        out = out.reshape(target.shape)
    return out, target


def _elementwise(fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out, target = _match(out, target)
        return fn(out, target, reduction="none")
    return loss


def class_dim(out: torch.Tensor, target: torch.Tensor) -> int | None:
    """The dimension of ``out`` that holds the classes of integer ``target``: 1 (``[N, C, ...]``
    against ``[N, ...]``, torch's convention) or the last (``[N, T, V]`` against ``[N, T]``, a
    language model's); the last for a 3-dim output when both fit; None when neither does."""
    if out.dim() != target.dim() + 1 or out.shape[0] != target.shape[0]:
        return None
    first = out.shape[2:] == target.shape[1:]
    last = out.shape[:-1] == target.shape
    if last and (not first or out.dim() == 3):
        return out.dim() - 1
    return 1 if first else None


def _classes_at(out: torch.Tensor, target: torch.Tensor) -> int:
    dim = class_dim(out, target)
    if dim is None:
        raise UsageError(f"Expected a model output with one more dimension than the targets {tuple(target.shape)} "
                         "(the classes, at dim 1 or last). Received: output "
                         f"{tuple(out.shape)}")
    return dim


def _classification(fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn`` (``F.cross_entropy``, ``F.nll_loss``) per sample: summed over a sample's valid
    positions when its target has more than one (the task divides by the valid positions)."""
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        try:
            if target.dim() <= 1:
                return fn(out, target, reduction="none")
            if _classes_at(out, target) == 1:
                values = fn(out, target, reduction="none", ignore_index=IGNORE_INDEX)
            else:  # [N, T, V]: the 2-d form, the fast path of both kernels
                values = fn(out.reshape(-1, out.shape[-1]), target.reshape(-1), reduction="none",
                            ignore_index=IGNORE_INDEX).view(target.shape)
        except IndexError:  # a label beyond the classes in a batch the start could not see: one line
            check_labels(out, target)
            raise
        return values.flatten(1).sum(1)
    return loss


def causal_lm(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Token cross-entropy with the targets shifted by one (logits at ``t`` predict target
    ``t + 1``), summed per sequence over its valid targets."""
    if out.dim() != 3 or target.dim() != 2 or out.shape[:2] != target.shape:
        raise UsageError(f"Expected logits [N, T, V] and targets [N, T] for loss 'causal_lm'. Received: output "
                         f"{tuple(out.shape)}, targets {tuple(target.shape)}")
    return _classification(F.cross_entropy)(out[:, :-1], target[:, 1:])


def check_labels(output: Any, targets: torch.Tensor, loss: str = "cross_entropy") -> None:
    """Integer labels all within the model's classes (one line naming the range when not),
    for a named loss whose class dimension is known (`class_dim`); ``-100`` is padding."""
    out = primary(output)
    if targets.is_floating_point() or targets.numel() == 0 or targets.is_meta or \
            loss not in ("cross_entropy", "nll", "causal_lm"):
        return
    sample = targets[: out.shape[0]]
    dim = class_dim(out, sample) if sample.shape[0] == out.shape[0] else None
    if dim is None:
        return
    classes = out.shape[dim]
    valid = targets[targets != IGNORE_INDEX]
    if valid.numel() == 0:
        return
    low, high = int(valid.min()), int(valid.max())
    if low < 0 or high >= classes:
        raise UsageError(f"Expected class labels in [0, {classes - 1}] for a model with {classes} outputs"
                         f"{' (-100: padding)' if targets.dim() > 1 else ''}. Received labels from {low} to {high}")


#: the built-in losses by name, one value per element (elementwise ones on targets shaped like the
#: output, `_match`); the streaming trainer's built-in losses are these too
NAMED_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": _classification(F.cross_entropy),
    "nll": _classification(F.nll_loss),
    "causal_lm": causal_lm,
    "bce": _elementwise(F.binary_cross_entropy_with_logits),
    "mse": _elementwise(F.mse_loss),
    "l1": _elementwise(F.l1_loss),
    "smooth_l1": _elementwise(F.smooth_l1_loss),
    "huber": _elementwise(F.huber_loss),
}


def per_sample(values: torch.Tensor, n: int, what: str = "loss_fn") -> torch.Tensor:
    """``values`` as one number per sample: shape ``(n,)``, trailing dimensions averaged."""
    if not isinstance(values, torch.Tensor):
        raise UsageError(f"Expected {what} to return a tensor of per-sample values. Received: {type(values).__name__}")
    if values.dim() == 0:
        if n == 1:
            return values.reshape(1)
        raise UsageError(
            f"Expected {what} to return one value per sample (shape ({n},)). Received: a single number for "
            f"{n} samples - a mean-reduced loss; use reduction='none' (partrain divides by the global batch)")
    if values.shape[0] != n:
        raise UsageError(f"Expected {what} to return one value per sample (shape ({n}, ...)). "
                         f"Received: shape {tuple(values.shape)}")
    return values.flatten(1).mean(1) if values.dim() > 1 else values


def per_sample_module(loss: nn.Module) -> nn.Module:
    """A ``torch.nn`` loss with ``reduction='mean'`` as the same loss per sample (or one line why not)."""
    reduction = getattr(loss, "reduction", "none")
    if reduction == "none":
        return loss
    name = type(loss).__name__
    if reduction != "mean":
        raise UsageError(f"Expected a per-sample loss (reduction='none' or 'mean'). Received: {name}(reduction="
                         f"{reduction!r}): partrain divides per-sample losses by the global batch itself")
    if getattr(loss, "weight", None) is not None:
        raise UsageError(f"Expected {name} without class weights, or with reduction='none'. Received: {name}("
                         "weight=..., reduction='mean'), whose mean divides by the summed weights, which a "
                         "per-sample loss cannot reproduce; pass reduction='none' to train on the weighted sum / N")
    exact = copy.copy(loss)
    exact.reduction = "none"
    return exact


# ----- metrics ---------------------------------------------------------------------------
def token_accuracy(output: Any, target: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """Per sample, the correct argmax predictions summed over its valid positions (the task
    divides by the valid positions); ``shift=1``: logits at ``t`` predict target ``t + 1``."""
    out = primary(output)
    if shift:
        out, target = out[:, :-shift], target[:, shift:]
    hit = (out.argmax(_classes_at(out, target)) == target) & (target != IGNORE_INDEX)
    return (hit.flatten(1).sum(1) if hit.dim() > 1 else hit).to(torch.float64)


def accuracy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Per-sample accuracy: argmax over classes, or the sign of a logit for binary targets."""
    out = primary(output)
    if not target.is_floating_point() and out.dim() == target.dim() + 1:
        hit = (out.argmax(_classes_at(out, target)) == target).to(torch.float64)
        if target.dim() > 1:  # the mean over each sample's valid positions (-100: padding)
            valid = (target != IGNORE_INDEX).flatten(1)
            return (hit.flatten(1) * valid).sum(1) / valid.sum(1).clamp(min=1)
    else:
        out, target = _match(out, target)
        hit = ((out > 0) == (target > 0.5)).to(torch.float64)
    return hit.flatten(1).mean(1) if hit.dim() > 1 else hit


def squared_error(output: Any, target: torch.Tensor) -> torch.Tensor:
    out, target = _match(primary(output), target)
    return (out - target).pow(2)


def absolute_error(output: Any, target: torch.Tensor) -> torch.Tensor:
    out, target = _match(primary(output), target)
    return (out - target).abs()


METRIC_FNS: dict[str, MetricFn] = {"accuracy": accuracy, "mse": squared_error, "mae": absolute_error,
                                 "token_accuracy": token_accuracy}


# ----- a model's own loss ----------------------------------------------------------------
#: Hugging Face heads by class-name ending, and the units their mean loss averages over:
#: a causal LM's valid targets after the shift by one, other token heads' valid targets, or
#: the samples (the loss families of ``transformers.loss``; a class's name sets its loss there too)
HF_HEADS: tuple[tuple[tuple[str, ...], str, int], ...] = (
    (("ForCausalLM", "LMHeadModel"), TOKENS, 1),
    (("ForMaskedLM", "ForTokenClassification", "ForConditionalGeneration"), TOKENS, 0),
    (("ForSequenceClassification", "ForImageClassification", "ForQuestionAnswering", "ForMultipleChoice",
      "ForAudioClassification"), SAMPLES, 0),
)


def own_loss_units(model: nn.Module) -> tuple[str, int] | None:
    """``(units, shift)`` that ``model``'s own mean loss averages over: a Hugging Face head's by its
    class name (`HF_HEADS`), samples for any other model; None: a Hugging Face model whose loss
    partrain does not know (it cannot re-weight it exactly)."""
    name = type(model).__name__
    if not type(model).__module__.startswith("transformers."):
        return SAMPLES, 0
    for endings, units, shift in HF_HEADS:
        if name.endswith(endings):
            return units, shift
    return None


def takes_argument(model: nn.Module, name: str, kwargs: bool = False) -> bool:
    """``model.forward`` has a parameter ``name`` (with ``kwargs``: or takes ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or kwargs and any(p.kind is p.VAR_KEYWORD for p in params.values())


def first_input_name(model: nn.Module) -> str:
    try:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[0].name if params else "input_ids"


class OwnLossOnMeta(Exception):
    """A model on the meta device returns a loss of its own: how it reduces it (`Task.adopt_own_loss`)
    needs values, so the check needs the model built for real."""


def own_loss_of(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, Mapping) else None
    return loss if isinstance(loss, torch.Tensor) else None
