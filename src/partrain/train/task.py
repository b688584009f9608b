"""What a batch is, how the model is called on it, and what the loss and metrics are.

`fit` trains on any batch structure `partrain.batch` describes (a pair ``(inputs, target)``,
a longer tuple whose last entry is the target, or a dict with the target under
``target_key``); the model is called on the rest.

``forward_fn(model, inputs)`` replaces the call when a model wants something else.
Models may return a tensor, a tuple or a dict; a named loss and the built-in metrics use
the *primary* output (the tensor, a tuple's first element, or a dict's ``logits`` /
``output`` / ``prediction`` entry); a user's ``loss_fn(output, target)`` receives the output
as the model returned it.

**The loss contract is per sample.** ``loss_fn`` returns one loss per sample (shape
``(N,)``; extra trailing dimensions are averaged). partrain divides the sum by the *global*
batch, which is what keeps data-parallel training equal to one process on the whole batch.
A ``torch.nn`` loss module built with ``reduction="mean"`` is detected and used with
``reduction="none"`` (the same objective, exactly); any other loss that returns one
number for a whole batch is refused with one line, since dividing its mean by the batch
again would silently shrink the gradient.

Named losses (``loss_fn="mse"``): ``cross_entropy``, ``nll``, ``bce`` (with logits),
``mse``, ``l1``, ``smooth_l1``, ``huber``; ``"auto"`` picks ``cross_entropy`` for integer
targets and ``mse`` for float ones. Metrics follow the task: ``accuracy`` for
classification, ``mse`` and ``mae`` for regression, or the names/functions the user gives.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._tree import map_tensors
from ..batch import batch_size, call_model, describe, primary, split_batch, tensors_of
from ..errors import UsageError

CLASSIFICATION_LOSSES = ("cross_entropy", "nll", "bce")
REGRESSION_LOSSES = ("mse", "l1", "smooth_l1", "huber")
LOSSES = ("auto", *CLASSIFICATION_LOSSES, *REGRESSION_LOSSES)
METRICS = ("accuracy", "mse", "mae")
PRECISIONS = ("fp32", "bf16")

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


def _classification(fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fn(out, target, reduction="none")
    return loss


def check_labels(output: Any, targets: torch.Tensor) -> None:
    """Integer labels all within the model's classes (one line naming the range when not)."""
    out = primary(output)
    if targets.is_floating_point() or out.dim() != targets.dim() + 1 or targets.numel() == 0:
        return
    classes = out.shape[1]
    low, high = int(targets.min()), int(targets.max())
    if low < 0 or high >= classes:
        raise UsageError(f"Expected class labels in [0, {classes - 1}] for a model with {classes} outputs. "
                         f"Received labels from {low} to {high}")


#: the built-in losses by name, one value per element (elementwise ones on targets shaped like the
#: output, `_match`); the streaming trainer's built-in losses are these too
NAMED_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": _classification(F.cross_entropy),
    "nll": _classification(F.nll_loss),
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


def _per_sample_module(loss: nn.Module) -> nn.Module:
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
def accuracy(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Per-sample accuracy: argmax over classes, or the sign of a logit for binary targets."""
    out = primary(output)
    if not target.is_floating_point() and out.dim() == target.dim() + 1:
        hit = (out.argmax(1) == target).to(torch.float64)
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


_METRICS: dict[str, MetricFn] = {"accuracy": accuracy, "mse": squared_error, "mae": absolute_error}


# ----- the task --------------------------------------------------------------------------
class Task:
    """How `fit` computes a batch's output, per-sample loss and metrics (picklable).

    Args:
        loss_fn: a name among `LOSSES`, or ``(output, target) -> per-sample losses``.
        metrics: names among `METRICS` and/or ``{name: (output, target) -> per-sample values}``;
            None: chosen by the task (accuracy for classification, mse and mae for regression).
        forward_fn: ``(model, inputs) -> output``; None: `call_model`.
        collate_fn: how samples form a batch (`torch.utils.data.DataLoader`'s); None: the default.
        target_key: the target's key in dict batches.
        precision: ``"fp32"`` or ``"bf16"`` (autocast of the forward pass; the loss in float32).
    """

    def __init__(self, loss_fn: str | LossFn = "auto", metrics: Sequence[str] | Mapping[str, MetricFn] | None = None,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None, collate_fn: Callable[[list], Any] | None = None,
                 target_key: str | None = None, precision: str = "fp32") -> None:
        if isinstance(loss_fn, str):
            if loss_fn not in LOSSES:
                raise UsageError(f"Expected a loss among {list(LOSSES)} or a function. Received: {loss_fn!r}")
        elif isinstance(loss_fn, nn.Module):
            loss_fn = _per_sample_module(loss_fn)
        elif not callable(loss_fn):
            raise UsageError(f"Expected loss_fn to be a loss name or a function. Received: {type(loss_fn).__name__}")
        if precision not in PRECISIONS:
            raise UsageError(f"Expected a precision among {list(PRECISIONS)}. Received: {precision!r}")
        self.loss_fn = loss_fn
        self.metric_spec = metrics
        self.forward_fn = forward_fn
        self.collate_fn = collate_fn
        self.target_key = target_key
        self.precision = precision
        self.metric_fns: dict[str, MetricFn] = {}
        self.kind = "custom"  # classification / regression / custom, set by resolve
        self._check_metric_spec()

    # -- set-up --------------------------------------------------------------------------
    def _check_metric_spec(self) -> None:
        spec = self.metric_spec
        if spec is None:
            return
        items = spec.items() if isinstance(spec, Mapping) else ((name, None) for name in spec)
        for name, fn in items:
            if fn is None and name not in _METRICS:
                raise UsageError(f"Expected metrics among {list(METRICS)} or {{name: function}}. Received: {name!r}")
            if fn is not None and not callable(fn):
                raise UsageError(f"Expected metric {name!r} to be a function. Received: {type(fn).__name__}")

    def resolve(self, sample_batch: Any) -> Task:
        """Fix ``"auto"`` and the default metrics from a batch of the data (idempotent)."""
        _, target = self.split(sample_batch)
        integer = isinstance(target, torch.Tensor) and not target.is_floating_point()
        if self.loss_fn == "auto":
            if not isinstance(target, torch.Tensor):
                raise UsageError("Expected a tensor target for loss 'auto' (or a loss_fn of your own). "
                                 f"Received: {describe(target)}")
            self.loss_fn = "cross_entropy" if integer else "mse"
        if isinstance(self.loss_fn, str):
            self.kind = "classification" if self.loss_fn in CLASSIFICATION_LOSSES else "regression"
        elif isinstance(target, torch.Tensor):
            self.kind = "classification" if integer else "custom"
        if self.metric_spec is None:
            names: Sequence[str] = (("accuracy",) if self.kind == "classification"
                                    else ("mse", "mae") if self.kind == "regression" else ())
            self.metric_fns = {n: _METRICS[n] for n in names}
        elif isinstance(self.metric_spec, Mapping):
            self.metric_fns = {n: (fn or _METRICS[n]) for n, fn in self.metric_spec.items()}
        else:
            self.metric_fns = {n: _METRICS[n] for n in self.metric_spec}
        return self

    @property
    def metric_names(self) -> list[str]:
        return list(self.metric_fns)

    @property
    def loss_name(self) -> str:
        return self.loss_fn if isinstance(self.loss_fn, str) else getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)

    # -- per batch -----------------------------------------------------------------------
    def split(self, batch: Any) -> tuple[Any, Any]:
        return split_batch(batch, self.target_key)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward(self, model: nn.Module, inputs: Any) -> Any:
        """The model's output on ``inputs`` (under autocast for ``bf16``)."""
        if self.precision == "fp32":
            return self.forward_fn(model, inputs) if self.forward_fn else call_model(model, inputs)
        device = next((t.device for _, t in tensors_of(inputs)), torch.device("cpu"))
        with self.autocast(device):
            return self.forward_fn(model, inputs) if self.forward_fn else call_model(model, inputs)

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """Per-sample losses, shape ``(N,)``."""
        n = batch_size(target)
        if isinstance(self.loss_fn, str):
            if self.loss_fn == "auto":
                raise RuntimeError("Task.resolve() must run before the loss is computed")
            out = primary(output)
            values = NAMED_LOSSES[self.loss_fn](out.float() if self.precision == "bf16" else out, target)
        else:
            values = self.loss_fn(_float_output(output) if self.precision == "bf16" else output, target)
        return per_sample(values, n)

    def metric_values(self, output: Any, target: Any) -> torch.Tensor:
        """Per-metric sums over the batch (float64, on the output's device)."""
        out = _float_output(output) if self.precision == "bf16" else output
        device = primary(out).device if self.metric_fns else torch.device("cpu")
        if not self.metric_fns:
            return torch.zeros(0, dtype=torch.float64, device=device)
        n = batch_size(target)
        return torch.stack([per_sample(fn(out, target), n, f"metric {name!r}").sum().to(torch.float64)
                            for name, fn in self.metric_fns.items()])

    def check(self, model: nn.Module, batch: Any, all_targets: torch.Tensor | None = None) -> None:
        """Run the model, the loss and the metrics on ``batch``: bad combinations fail here.

        ``all_targets`` (every target of the data, when at hand) is checked against the model's
        classes for a classification loss.
        """
        inputs, target = self.split(batch)
        with torch.no_grad():
            output = self.forward(model, inputs)
            if self.kind == "classification" and isinstance(target, torch.Tensor):
                check_labels(output, all_targets if all_targets is not None else target)
            self.loss(output, target)
            self.metric_values(output, target)

    def describe(self) -> dict[str, Any]:
        """The task as JSON-able settings (for config.json)."""
        return {"loss": self.loss_name, "kind": self.kind, "metrics": self.metric_names,
                "precision": self.precision, "target_key": self.target_key,
                "forward_fn": _qualname(self.forward_fn), "collate_fn": _qualname(self.collate_fn)}


def _float_output(output: Any) -> Any:
    return map_tensors(output, lambda t: t.float() if t.is_floating_point() else t)


def _qualname(fn: Any) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"

