"""Functional optimizers over a whole population at once.

Vocabulary: a population's trainable parameters live in one **flat buffer**
shaped ``(members, D)`` (row ``i`` is member ``i``'s parameters, concatenated
in ``named_parameters()`` order). Optimizer state is buffers of the same shape,
plus a ``step`` count per member. Hyperparameters are tensors shaped
``(members, 1)`` so one member's learning rate broadcasts over its row.

Each update is a handful of tensor operations over the whole buffer - no
per-member Python loop - and follows ``torch.optim`` step for step (same
formulas, same order) so a member trained here matches the same model trained
with ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` to float rounding.

The same buffers double as ``torch.optim`` state: the loop engine hands row
views of them to real ``torch.optim`` optimizers, which update them in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from ..errors import UsageError


class FunctionalOptimizer(ABC):
    """A batched optimizer: one `step` updates every member's row of the flat buffer."""

    name: ClassVar[str]
    #: per-member hyperparameters this optimizer reads, with torch.optim's defaults
    defaults: ClassVar[dict[str, float]]
    #: names of the state buffers (each shaped like the flat parameter buffer)
    state_keys: ClassVar[tuple[str, ...]]
    torch_class: ClassVar[type[torch.optim.Optimizer]]
    #: whether the torch.optim twin keeps a per-parameter "step" in its state
    torch_counts_steps: ClassVar[bool] = False

    def init_state(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zeroed state buffers for a flat parameter buffer, plus a per-member step count."""
        state = {k: torch.zeros_like(flat) for k in self.state_keys}
        state["step"] = torch.zeros(flat.shape[0], dtype=torch.float32, device=flat.device)
        return state

    @abstractmethod
    def step(self, flat: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             hp: dict[str, torch.Tensor]) -> None:
        """Update ``flat`` in place from ``grad``; ``hp`` values are shaped (members, 1)."""

    @abstractmethod
    def torch_group(self, hp: dict[str, float]) -> dict[str, Any]:
        """The ``torch.optim`` param-group options equal to one member's hyperparameters."""

    def torch_optimizer(self, params: list[torch.nn.Parameter], hp: dict[str, float]) -> torch.optim.Optimizer:
        """A real ``torch.optim`` optimizer with one member's hyperparameters (single-tensor path)."""
        return self.torch_class(params, foreach=False, **self.torch_group(hp))

    def set_torch_group(self, optimizer: torch.optim.Optimizer, hp: dict[str, float]) -> None:
        """Write one member's (possibly changed) hyperparameters into its optimizer."""
        optimizer.param_groups[0].update(self.torch_group(hp))


class SGD(FunctionalOptimizer):
    """SGD with momentum, Nesterov and L2 weight decay, as ``torch.optim.SGD`` (dampening 0).

    ``torch.optim.SGD`` starts its momentum buffer at the first gradient; with
    dampening 0 that equals ``0 * momentum + grad``, so a zero-initialized
    buffer gives the same numbers without a first-step branch.
    """

    name = "sgd"
    defaults = {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0}
    state_keys = ("momentum_buffer",)
    torch_class = torch.optim.SGD

    def __init__(self, nesterov: bool = False) -> None:
        self.nesterov = nesterov

    def step(self, flat: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             hp: dict[str, torch.Tensor]) -> None:
        lr, momentum, wd = hp["lr"], hp["momentum"], hp["weight_decay"]
        d_p = torch.addcmul(grad, flat, wd)  # grad + wd * param
        buf = state["momentum_buffer"]
        buf.mul_(momentum).add_(d_p)
        d_p = torch.addcmul(d_p, buf, momentum) if self.nesterov else buf
        flat.addcmul_(d_p, lr, value=-1.0)
        # a member without momentum keeps no buffer in torch.optim: keep its row at zero, so a
        # later non-zero momentum (PBT) starts from the first gradient exactly like torch.optim
        buf.mul_(momentum != 0)

    def torch_group(self, hp: dict[str, float]) -> dict[str, Any]:
        return {"lr": hp["lr"], "momentum": hp["momentum"], "weight_decay": hp["weight_decay"],
                "nesterov": self.nesterov, "dampening": 0.0}


class Adam(FunctionalOptimizer):
    """Adam (L2 weight decay) or AdamW (decoupled weight decay), as ``torch.optim``.

    Bias corrections depend on each member's own step count, so members that
    joined late or copied another member (PBT) keep exact Adam semantics.
    """

    name = "adam"
    defaults = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    state_keys = ("exp_avg", "exp_avg_sq")
    torch_class = torch.optim.Adam
    torch_counts_steps = True

    def __init__(self, decoupled: bool = False) -> None:
        self.decoupled = decoupled

    def step(self, flat: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
             hp: dict[str, torch.Tensor]) -> None:
        lr, beta1, beta2, eps, wd = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]
        step = state["step"] + 1  # the caller advances the stored count
        if self.decoupled:
            flat.mul_(1.0 - lr * wd)
        else:
            grad = torch.addcmul(grad, flat, wd)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad * (1.0 - beta2))
        # torch.optim computes the bias corrections in double precision from the step count
        s = step.to(torch.float64).unsqueeze(1)
        bias1 = 1.0 - beta1.to(torch.float64) ** s
        bias2_sqrt = (1.0 - beta2.to(torch.float64) ** s).sqrt()
        step_size = (lr.to(torch.float64) / bias1).to(flat.dtype)
        denom = (exp_avg_sq.sqrt() / bias2_sqrt.to(flat.dtype)).add_(eps)
        flat.addcdiv_(exp_avg * step_size, denom, value=-1.0)

    def torch_group(self, hp: dict[str, float]) -> dict[str, Any]:
        return {"lr": hp["lr"], "betas": (hp["beta1"], hp["beta2"]), "eps": hp["eps"],
                "weight_decay": hp["weight_decay"]}


class AdamW(Adam):
    """AdamW: Adam with decoupled weight decay (torch's default weight decay 0.01)."""

    name = "adamw"
    defaults = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}
    torch_class = torch.optim.AdamW

    def __init__(self) -> None:
        super().__init__(decoupled=True)


OPTIMIZERS: dict[str, type[FunctionalOptimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(name: str, nesterov: bool = False) -> FunctionalOptimizer:
    """The functional optimizer called ``name`` ("sgd", "adam", "adamw")."""
    if name not in OPTIMIZERS:
        raise UsageError(f"Expected an optimizer among {sorted(OPTIMIZERS)}. Received: {name!r}")
    if nesterov and name != "sgd":
        raise UsageError(f"Expected nesterov only with optimizer 'sgd'. Received: optimizer={name!r}")
    return SGD(nesterov) if name == "sgd" else OPTIMIZERS[name]()
