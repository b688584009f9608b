"""Shared pieces of the test suite: small factories that pickle to worker processes, and references.

Equivalence tests (two training runs that must agree: allreduce and one process,
a resumed run and an uninterrupted one, ...) run in **float64** with the
``*64`` factories here and compare to `F64_ATOL`. Why: two runs that add the
same numbers in another order (another intra-op thread count, another CPU's
kernels, a sum split over workers) differ by rounding, and momentum compounds it
over the steps. In float32 that reached 2e-5 after 20 steps on one CPU
(about 170 float32 ulps of 1.2e-7) and passed on another. The same growth in
float64 (unit roundoff 1.1e-16) stays near 1e-14, so `F64_ATOL` = 1e-10 leaves
a margin of about 10^4 on any CPU and thread count, while a real divergence (a
sample dropped from a batch of 96, a wrong normalisation, a missed step) moves
the parameters by 1e-4 or more, a million times the tolerance.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from partrain.data.datasets import load_digits
from partrain.models import cnn, mlp

F64_ATOL = 1e-10  # for float64 equivalence tests of tens of steps: see the module docstring


def small_cnn():
    return cnn(width=8)


def small_mlp():
    return mlp(in_features=64, hidden=32, depth=1)


def small_cnn64() -> nn.Module:
    return small_cnn().double()


def small_mlp64() -> nn.Module:
    return small_mlp().double()


def to_float64(ds: TensorDataset) -> TensorDataset:
    """The same samples with float64 inputs (labels untouched)."""
    x, y = ds.tensors
    return TensorDataset(x.double(), y)


DIGITS64_TRAIN = 1437  # odd: the last global batch of an epoch splits unevenly between 2 workers


def digits64() -> tuple[TensorDataset, TensorDataset]:
    """The ``"digits"`` split of `fit` in float64, less one training sample (a module-level function: it pickles).

    1437 training samples instead of 1438: with an even count and 2 workers the last
    batch of an epoch splits into equal halves, where averaging per-worker mean losses
    happens to give the right answer; with an odd count it does not, so the tests see
    whether the loss is normalised by the global sample count.
    """
    train, test = load_digits()
    x, y = train.tensors
    return to_float64(TensorDataset(x[:DIGITS64_TRAIN], y[:DIGITS64_TRAIN])), to_float64(test)


def sgd(params, lr=0.05, momentum=0.9, weight_decay=1e-4):
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


sgd_plain = functools.partial(sgd, momentum=0.0, weight_decay=0.0)


def assert_states_close(a, b, atol=F64_ATOL):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, then give the caller's setting back.

    For speed only, where float64 makes the result independent of the thread count:
    on a loaded 2-core machine, OpenMP threads that spin-wait for a busy core made a
    small float64 model 10x slower with 2 threads than with 1.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def epoch_order(num_samples: int, epoch: int, seed: int = 0) -> torch.Tensor:
    """The sample order of ``epoch`` that `fit`'s workers cut their batches from.

    Written out here (see `partrain.data.sharding.ShardedBatchSampler.order`) so that
    a reference does not use the sampler it checks.
    """
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def train_by_hand(model_fn: Callable[[], nn.Module], data_fn: Callable[[], tuple[TensorDataset, TensorDataset]],
                  optimizer_fn: Callable[..., torch.optim.Optimizer], *, batch: int, epochs: int,
                  max_steps: int | None = None, scheduler_fn: Callable[[Any], Any] | None = None,
                  seed: int = 0,
                  samples_per_epoch: int | None = None) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """One process, plain PyTorch: the reference for `fit` on the global batch.

    Its own batching (consecutive slices of `epoch_order`, the last one of an epoch
    shorter) and ``F.cross_entropy(..., reduction="mean")``: no partrain sampler,
    no loss normalisation. Returns the final ``state_dict`` and, per epoch, the
    figures `fit` reports (train loss and accuracy over the samples seen, test
    loss and accuracy after the epoch, step count, learning rate).

    ``samples_per_epoch``: every epoch's order laid end to end, an epoch is then the next
    ``samples_per_epoch`` of them (`FitConfig.samples_per_epoch`).
    """
    with torch_threads(1):  # speed only: float64 (see the module docstring)
        return _train_by_hand(model_fn, data_fn, optimizer_fn, batch, epochs, max_steps, scheduler_fn, seed,
                              samples_per_epoch)


def _train_by_hand(model_fn: Callable[[], nn.Module], data_fn: Callable[[], tuple[TensorDataset, TensorDataset]],
                   optimizer_fn: Callable[..., torch.optim.Optimizer], batch: int, epochs: int,
                   max_steps: int | None, scheduler_fn: Callable[[Any], Any] | None,
                   seed: int,
                   samples_per_epoch: int | None = None) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    train, test = data_fn()
    x_all, y_all = train.tensors
    if samples_per_epoch is not None:
        passes = -(-epochs * samples_per_epoch // len(x_all))
        stream = torch.cat([epoch_order(len(x_all), p, seed) for p in range(passes)])
    torch.manual_seed(seed)  # fit seeds the same way before it calls the model factory
    model = model_fn()
    optimizer = optimizer_fn(model.parameters())
    scheduler = scheduler_fn(optimizer) if scheduler_fn else None
    step, history = 0, []
    for epoch in range(epochs):
        if max_steps is not None and step >= max_steps:
            break
        order = epoch_order(len(x_all), epoch, seed) if samples_per_epoch is None else \
            stream[epoch * samples_per_epoch:(epoch + 1) * samples_per_epoch]
        model.train()
        loss_sum, correct, seen = 0.0, 0, 0
        for start in range(0, len(order), batch):
            index = order[start : start + batch]
            x, y = x_all[index], y_all[index]
            out = model(x)
            loss = F.cross_entropy(out, y, reduction="mean")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            loss_sum += loss.item() * len(y)
            correct += int((out.argmax(1) == y).sum())
            seen += len(y)
            if max_steps is not None and step >= max_steps:
                break
        if scheduler is not None:
            scheduler.step()
        model.eval()
        with torch.no_grad():
            x_test, y_test = test.tensors
            out = model(x_test)
            test_loss = F.cross_entropy(out, y_test, reduction="mean").item()
            test_accuracy = (out.argmax(1) == y_test).double().mean().item()
        history.append({"epoch": epoch + 1, "step": step, "samples": seen, "train_loss": loss_sum / seen,
                        "train_accuracy": correct / seen, "test_loss": test_loss,
                        "test_accuracy": test_accuracy, "lr": optimizer.param_groups[0]["lr"]})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, history


def assert_history_matches(got: list[dict[str, Any]], want: list[dict[str, Any]], atol: float = F64_ATOL) -> None:
    """`fit`'s per-epoch figures against `train_by_hand`'s: counts exact, losses to ``atol``.

    Accuracies are compared exactly: an argmax flips only where two float64 logits
    lie within rounding of each other.
    """
    assert len(got) == len(want), ([r["epoch"] for r in got], [r["epoch"] for r in want])
    for g, w in zip(got, want):
        for key in ("epoch", "step", "samples", "train_accuracy", "test_accuracy"):
            assert g[key] == w[key], (w["epoch"], key, g[key], w[key])
        for key in ("train_loss", "test_loss", "lr"):
            assert math.isclose(g[key], w[key], rel_tol=0, abs_tol=atol), (w["epoch"], key, g[key], w[key])


class KillOnRank(nn.Module):
    """Identity, except on global rank ``rank`` at its third training forward: SIGKILL (no
    unwinding, as ``kill -9`` or the OOM killer), for the tests of a rank dying mid-step."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.calls = rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.training and os.environ.get("RANK") == str(self.rank) and self.calls == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return x
