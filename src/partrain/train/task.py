"""What a batch is, how the model is called on it, and what the loss and metrics are (the named
losses and metrics themselves: `partrain.train.losses`).

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
``mse``, ``l1``, ``smooth_l1``, ``huber``, ``causal_lm``; ``"auto"`` picks ``cross_entropy``
for integer targets and ``mse`` for float ones. Metrics follow the task: ``accuracy`` for
classification, ``mse`` and ``mae`` for regression, ``token_accuracy`` and ``perplexity``
for token-level tasks, or the names/functions the user gives.

**Token-level losses.** ``cross_entropy`` and ``nll`` on targets with more than one
dimension (``[N, T]`` tokens, ``[N, H, W]`` pixels) are per element: positions whose target
is ``-100`` (`IGNORE_INDEX`, padding) count nowhere, and a step divides the summed loss by
the valid positions of the *global* batch (one small all-reduce per step under a strategy
that averages gradients every step), so that 2 workers with different numbers of valid
tokens equal one process on the concatenated batch exactly, as ``F.cross_entropy``'s mean
over that batch would. The classes are dim 1 (``[N, C, ...]``, torch's convention) or the
last (``[N, T, V]`` against ``[N, T]``, as language models give; taken for a 3-dim output
when both fit). ``causal_lm`` is the same loss with the targets shifted by one: position
``t`` of the logits predicts target ``t + 1`` (Hugging Face's ``labels = input_ids``).
The epoch's loss and ``token_accuracy`` are then per valid token; ``perplexity`` is
``exp`` of the loss per token.

**A model's own loss.** With no ``loss_fn`` (``"auto"``) and a model whose output carries a
``loss`` (a Hugging Face ``ModelOutput``, a dict), `fit` trains on it, passing the target as
``labels=`` when the model's forward takes ``labels``. A mean is made a sum again by the
units it averaged (see `own_loss_units`) and divided like a named loss, so that data
parallel equals one process on the global batch; a loss whose units are unknown is refused
in one line for more than one worker or accumulated steps.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .._tree import map_tensors
from ..batch import batch_size, call_model, describe, primary, split_batch, tensors_of
from ..errors import UsageError
from ..nn.partial import on_meta
from .losses import (  # noqa: F401 - re-exported: the task's vocabulary is imported from here
    CLASSIFICATION_LOSSES,
    DERIVED_METRICS,
    HF_HEADS,
    IGNORE_INDEX,
    LOSSES,
    METRIC_FNS,
    METRICS,
    NAMED_LOSSES,
    OWN_LOSS,
    PRECISIONS,
    REGRESSION_LOSSES,
    SAMPLES,
    TOKENS,
    LossFn,
    MetricFn,
    OwnLossOnMeta,
    absolute_error,
    accuracy,
    causal_lm,
    check_labels,
    class_dim,
    first_input_name,
    own_loss_of,
    own_loss_units,
    per_sample,
    per_sample_module,
    squared_error,
    takes_argument,
    token_accuracy,
)


# ----- the task --------------------------------------------------------------------------
class Task:
    """How `fit` computes a batch's output, per-sample loss and metrics (picklable).

    Args:
        loss_fn: a name among `LOSSES` (``"own"``: the model's own loss, which ``"auto"`` takes
            when the model gives one), or ``(output, target) -> per-sample losses``.
        metrics: names among `METRICS` and/or ``{name: (output, target) -> per-sample values}``;
            None: chosen by the task (accuracy for classification, mse and mae for regression,
            token_accuracy and perplexity for token-level losses).
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
            loss_fn = per_sample_module(loss_fn)
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
        #: metrics summed per loss unit (token_accuracy), not per sample; and those derived from the loss
        self.unit_metrics: set[str] = set()
        self.derived: list[str] = []
        self.kind = "custom"  # classification / regression / custom, set by resolve
        #: what a step's loss is divided by: the global batch's SAMPLES, or its valid TOKENS
        self.units = SAMPLES
        #: targets start this many positions after the outputs (1: a causal language model's)
        self.shift = 0
        #: the model's own loss (``loss_fn="own"``): its keyword for the target (None: the
        #: target is not passed), its first input's name, whether its loss comes back summed
        #: (``num_items_in_batch=1``) or as a mean, and whether its units are known
        self.labels_key: str | None = None
        self.input_name = "input_ids"
        self.own_reduction = "mean"
        self.own_units_known = True
        self.own_model = ""
        self._auto = loss_fn == "auto"
        self._check_metric_spec()

    # -- set-up --------------------------------------------------------------------------
    def _check_metric_spec(self) -> None:
        spec = self.metric_spec
        if spec is None:
            return
        items = spec.items() if isinstance(spec, Mapping) else ((name, None) for name in spec)
        for name, fn in items:
            if fn is None and name not in METRICS:
                raise UsageError(f"Expected metrics among {list(METRICS)} or {{name: function}}. Received: {name!r}")
            if fn is not None and not callable(fn):
                raise UsageError(f"Expected metric {name!r} to be a function. Received: {type(fn).__name__}")

    @property
    def own_loss(self) -> bool:
        return self.loss_fn == OWN_LOSS

    def resolve(self, sample_batch: Any) -> Task:
        """Fix ``"auto"``, the loss units and the default metrics from a batch of the data (idempotent)."""
        _, target = split_batch(sample_batch, self.target_key)
        integer = isinstance(target, torch.Tensor) and not target.is_floating_point()
        if self.loss_fn == "auto":
            if not isinstance(target, torch.Tensor):
                raise UsageError("Expected a tensor target for loss 'auto' (or a loss_fn of your own). "
                                 f"Received: {describe(target)}")
            self.loss_fn = "cross_entropy" if integer else "mse"
        if isinstance(self.loss_fn, str) and not self.own_loss:
            self.kind = "classification" if self.loss_fn in CLASSIFICATION_LOSSES else "regression"
            token = self.loss_fn in ("cross_entropy", "nll", "causal_lm") and integer and target.dim() >= 2
            self.units, self.shift = (TOKENS if token else SAMPLES), (1 if self.loss_fn == "causal_lm" else 0)
        elif isinstance(target, torch.Tensor) and not self.own_loss:
            self.kind = "classification" if integer else "custom"
        self._choose_metrics()
        return self

    def _choose_metrics(self) -> None:
        token = self.units == TOKENS
        spec = self.metric_spec
        if spec is None:
            names: Sequence[str] = (("token_accuracy", "perplexity") if token and self.kind == "classification"
                                    else ("accuracy",) if self.kind == "classification"
                                    else ("mse", "mae") if self.kind == "regression" else ())
            items: dict[str, MetricFn | None] = dict.fromkeys(names)
        else:
            items = dict(spec) if isinstance(spec, Mapping) else dict.fromkeys(spec)
        self.metric_fns, self.unit_metrics, self.derived = {}, set(), []
        for name, fn in items.items():
            if fn is None and name in DERIVED_METRICS:
                self.derived.append(name)
                continue
            if fn is None and (name == "token_accuracy" or (token and name == "accuracy")):
                fn = functools.partial(token_accuracy, shift=self.shift)
                self.unit_metrics.add(name)
            self.metric_fns[name] = fn or METRIC_FNS[name]

    def adopt_own_loss(self, model: nn.Module, batch: Any) -> bool:
        """With ``"auto"`` or ``"own"``: when ``model``'s output carries a ``loss`` (the target passed
        as ``labels=`` when its forward takes it), train on that loss. True when it does."""
        if not (self._auto or self.own_loss) or self.forward_fn is not None and not self.own_loss:
            return False
        inputs, target = split_batch(batch, self.target_key)
        loose = isinstance(inputs, Mapping) or isinstance(inputs, torch.Tensor)
        self.labels_key = "labels" if loose and takes_argument(model, "labels") and "labels" not in (
            inputs if isinstance(inputs, Mapping) else {}) else None
        self.input_name = first_input_name(model)
        self.own_reduction = "mean"
        if self.labels_key is not None and on_meta(model):
            raise OwnLossOnMeta(type(model).__name__)  # whether and how it computes a loss: values only
        try:
            with torch.no_grad():
                loss = own_loss_of(self.forward(model, self.split(batch)[0]))
        except Exception:  # noqa: BLE001 - e.g. a model that takes labels of another kind: the usual check says why
            if self.own_loss or self.labels_key is None:
                raise
            self.labels_key, loss = None, None
        if loss is not None and loss.is_meta:  # how the model reduces its loss is read off values
            raise OwnLossOnMeta(type(model).__name__)
        if loss is None:
            self.labels_key = None
            if self.own_loss:
                raise UsageError(f"Expected a model whose output carries a 'loss' for loss_fn='own'. Received: "
                                 f"{type(model).__name__} returning no loss")
            return False
        if loss.dim() != 0:
            raise UsageError(f"Expected the model's own loss to be one number (a mean). Received: shape "
                             f"{tuple(loss.shape)}")
        units = own_loss_units(model)
        self.loss_fn, self.kind, self.own_model = OWN_LOSS, "custom", type(model).__name__
        self.own_units_known = units is not None
        self.units, self.shift = units or (SAMPLES, 0)
        if self.units == TOKENS:
            self.kind = "classification"
        count = self.count(target)
        if self.labels_key is not None and count > 0 and takes_argument(model, "num_items_in_batch", kwargs=True):
            self.own_reduction = "sum"  # the model sums when told how many units it averages over
            try:
                with torch.no_grad():
                    summed = own_loss_of(self.forward(model, self.split(batch)[0]))
            except Exception:  # noqa: BLE001 - it does not take the keyword after all: the mean, re-weighted
                summed = None
            if summed is None or not torch.allclose(summed.double(), loss.double() * count, rtol=1e-3, atol=1e-6):
                self.own_reduction = "mean"
        self._choose_metrics()
        return True

    def own_loss_line(self) -> str:
        """How the model's own loss is re-weighted, for the line a run prints at its start."""
        what = ("the valid targets after the shift by one" if self.shift else "the valid targets (not -100)"
                ) if self.units == TOKENS else "the samples"
        how = ("summed by the model (num_items_in_batch=1)" if self.own_reduction == "sum"
               else f"its mean times the batch's count of {what}")
        known = "" if self.own_units_known else " (a head partrain does not know: taken as a mean over samples)"
        return (f"partrain: training on {self.own_model}'s own loss, a mean over {what}{known}: each batch's loss "
                f"{how}, divided by the {'valid targets' if self.units == TOKENS else 'samples'} of the global batch, "
                "so that data-parallel workers equal one process on the global batch")

    def check_exact(self, workers: int, accumulate: int) -> None:
        """One line when the model's own loss cannot be made exact for this run (more than one
        micro-batch per step, and a Hugging Face head whose loss units partrain does not know)."""
        if self.own_loss and not self.own_units_known and (workers > 1 or accumulate > 1):
            raise UsageError(f"Expected a model whose own loss partrain can re-weight exactly (Hugging Face heads "
                             f"ending in {', '.join(e for ends, _, _ in HF_HEADS for e in ends)}) for {workers} "
                             f"workers x accumulate {accumulate}. Received: {self.own_model}; pass loss_fn (e.g. "
                             "'causal_lm' on its logits) or run one worker")

    @property
    def metric_names(self) -> list[str]:
        """The metrics summed per batch (`metric_values`' order)."""
        return list(self.metric_fns)

    @property
    def reported_metrics(self) -> list[str]:
        """Every metric a run reports: the summed ones, then those derived from the loss."""
        return [*self.metric_fns, *self.derived]

    @property
    def loss_name(self) -> str:
        return self.loss_fn if isinstance(self.loss_fn, str) else getattr(self.loss_fn, "__name__", type(self.loss_fn).__name__)

    # -- per batch -----------------------------------------------------------------------
    def split(self, batch: Any) -> tuple[Any, Any]:
        """``(inputs, target)``; the inputs carry the target as ``labels`` for a model's own loss."""
        inputs, target = split_batch(batch, self.target_key)
        if self.labels_key is not None:
            extra: dict[str, Any] = {self.labels_key: target}
            if self.own_reduction == "sum":
                extra["num_items_in_batch"] = 1
            inputs = {**inputs, **extra} if isinstance(inputs, Mapping) else {self.input_name: inputs, **extra}
        return inputs, target

    def count(self, target: Any) -> int:
        """The loss units in a batch: its samples, or its valid target positions (`TOKENS`)."""
        if self.units == SAMPLES:
            return batch_size(target)
        valid = target[:, self.shift:] if self.shift else target
        return int((valid != IGNORE_INDEX).sum())

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
        """Per-sample losses, shape ``(N,)`` (for token-level tasks, sums over each sample's tokens)."""
        n = batch_size(target)
        if isinstance(self.loss_fn, str):
            if self.loss_fn == "auto":
                raise RuntimeError("Task.resolve() must run before the loss is computed")
            if self.own_loss:
                return self._own(output, target, n)
            out = primary(output)
            values = NAMED_LOSSES[self.loss_fn](out.float() if self.precision == "bf16" else out, target)
        else:
            values = self.loss_fn(_float_output(output) if self.precision == "bf16" else output, target)
        return per_sample(values, n)

    def _own(self, output: Any, target: Any, n: int) -> torch.Tensor:
        """The model's own loss as its sum over the batch's units, spread evenly over the samples."""
        loss = own_loss_of(output)
        if loss is None:
            raise UsageError(f"Expected the model's output to carry a 'loss' on every batch. Received: {describe(output)}")
        total = loss.float()
        if self.own_reduction == "mean":
            count = self.count(target)
            # no valid target in this micro-batch: a zero that still reaches every parameter (a mean over
            # nothing is NaN, whose gradient would poison the step)
            total = total * count if count else primary(output).sum() * 0.0
        return (total / n).expand(n)

    def metric_values(self, output: Any, target: Any) -> torch.Tensor:
        """Per-metric sums over the batch (float64, on the output's device)."""
        if not self.metric_fns:
            return torch.zeros(0, dtype=torch.float64, device=torch.device("cpu"))
        return torch.stack([v.sum(dtype=torch.float64) for v in self.metric_samples(output, target)])

    def metric_samples(self, output: Any, target: Any) -> list[torch.Tensor]:
        """Each metric's per-sample values on the batch, in `metric_names`' order (`metric_values`
        sums them; a training epoch sums many batches' at once)."""
        out = _float_output(output) if self.precision == "bf16" else output
        n = batch_size(target)
        return [per_sample(fn(out, target), n, f"metric {name!r}") for name, fn in self.metric_fns.items()]

    def means(self, loss_sum: float, units: float, samples: float, sums: Sequence[float]) -> tuple[float, dict[str, float]]:
        """The loss per unit and every reported metric from sums over some batches."""
        loss = loss_sum / max(units, 1.0)
        values = {name: float(sums[k]) / max(units if name in self.unit_metrics else samples, 1.0)
                  for k, name in enumerate(self.metric_fns)}
        for name in self.derived:  # perplexity: exp of the loss per unit
            values[name] = math.exp(min(loss, 700.0)) if loss == loss else math.nan
        return loss, values

    def check(self, model: nn.Module, batch: Any, all_targets: torch.Tensor | None = None) -> None:
        """Run the model, the loss and the metrics on ``batch``: bad combinations fail here.

        ``all_targets`` (every target of the data, when at hand) is checked against the model's
        classes for a named classification loss (a loss of the user's is never second-guessed).
        A model that computes its own loss is taken up here (`adopt_own_loss`).
        """
        self.adopt_own_loss(model, batch)
        inputs, target = self.split(batch)
        with torch.no_grad():
            output = self.forward(model, inputs)
            if self.kind == "classification" and isinstance(self.loss_fn, str) and isinstance(target, torch.Tensor):
                check_labels(output, all_targets if all_targets is not None else target, self.loss_fn)
            self.loss(output, target)
            self.metric_values(output, target)

    def describe(self) -> dict[str, Any]:
        """The task as JSON-able settings (for config.json)."""
        return {"loss": self.loss_name, "kind": self.kind, "units": self.units, "metrics": self.reported_metrics,
                "precision": self.precision, "target_key": self.target_key,
                "forward_fn": _qualname(self.forward_fn), "collate_fn": _qualname(self.collate_fn)}


def _float_output(output: Any) -> Any:
    return map_tensors(output, lambda t: t.float() if t.is_floating_point() else t)


def _qualname(fn: Any) -> str | None:
    if fn is None:
        return None
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"

