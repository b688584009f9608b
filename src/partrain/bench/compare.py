"""Compare: is ``partrain compare``'s recommendation the strategy that reaches a target loss first?

Four built-in scenarios, each a model and a synthetic task (Gaussian clusters, noisy
enough that the loss falls over several epochs), 2 workers of one thread each:

- ``compute``: a convolutional net with few parameters (three 3x3 convolutions, global
  average pooling) on 16x16 images: compute-bound;
- ``comm``: a dense MLP (two 1024-wide hidden layers, 1.1 M parameters) at batch 8:
  communication-heavy;
- ``straggler``: a small convolutional net with worker 1 slowed 3x (an injected delay);
- ``split``: a deep MLP of eight layers, a model a pipeline can cut.

In each: ``partrain.compare`` with its default budget (60 s; quick 20 s) recommends a
strategy; then every strategy it measured trains for the same wall time (8 s; quick 3 s)
with per-epoch evaluations, and the target loss is the median of the lowest test losses
they reached. The time to target is the training time (evaluations left out) until a
strategy's test loss first reaches it, interpolated within the epoch.

Goals (issue 16): compare.regret_max (over scenarios, the recommended strategy's time to
target over the fastest's, minus 1) <= 0.10; compare.prediction_error (over the scenarios
without a straggler, the largest relative error of the 2-worker allreduce samples/s
predicted from the one-worker window and the probed local link, against the measured
one) <= 0.20; compare.budget_overrun (over scenarios, compare's wall time over its budget,
minus 1) <= 0.10. Every run shares one pool of processes, started before the first one.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..compare import compare
from ..compare.decide import loss_at  # noqa: F401 - kept for readers: the same interpolation as compare's
from ..compare.report import format_result
from ..pool import WorkerPool
from ..strategies import get_strategy
from ..train.loop import fit
from .harness import Report, pick_size, positive_int


@dataclass(frozen=True)
class Size:
    budget: float  # compare's budget, seconds
    train_s: float  # wall time of each strategy's run to the target
    samples: int


FULL = Size(budget=60.0, train_s=8.0, samples=2048)
QUICK = Size(budget=14.0, train_s=2.0, samples=1024)
TOY = Size(budget=5.0, train_s=0.6, samples=512)


# ----- the scenarios --------------------------------------------------------------------------

def clusters(samples: int, shape: tuple[int, ...], seed: int = 0, noise: float = 2.0) -> tuple[TensorDataset,
                                                                                                  TensorDataset]:
    """Ten Gaussian clusters of samples of ``shape``; a quarter as many held out."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, *shape, generator=g)
    n = samples + samples // 4
    y = torch.randint(0, 10, (n,), generator=g)
    x = centers[y] + noise * torch.randn(n, *shape, generator=g)
    return TensorDataset(x[:samples], y[:samples]), TensorDataset(x[samples:], y[samples:])


def conv_net(width: int = 32) -> nn.Module:
    """Three 3x3 convolutions and global average pooling: much compute, few parameters."""
    return nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(width, 10))


def dense_mlp(in_features: int = 64, hidden: int = 1024, depth: int = 2) -> nn.Module:
    """Wide dense layers: many parameters, little compute per sample."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, 10))


def sgd(params: Any, lr: float = 0.02) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    model_fn: Any
    shape: tuple[int, ...]
    batch_size: int
    straggler: str | None = None
    lr: float = 0.02


SCENARIOS = (
    Scenario("compute", "conv net, 16x16, few parameters", functools.partial(conv_net, 32), (1, 16, 16), 32),
    Scenario("comm", "dense MLP 1.1 M parameters, batch 8", functools.partial(dense_mlp, 64, 1024, 2), (1, 8, 8), 8,
             lr=0.01),
    Scenario("straggler", "conv net, worker 1 slowed 3x", functools.partial(conv_net, 16), (1, 8, 8), 32,
             straggler="worker=1,slowdown=3"),
    Scenario("split", "deep MLP, 8 layers (a pipeline cuts it)", functools.partial(dense_mlp, 64, 256, 7),
             (1, 8, 8), 32),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget", type=float, default=None, help="compare's budget in seconds (default 60, quick 14)")
    p.add_argument("--train-seconds", type=float, default=None,
                   help="wall time of each strategy's run to the target (default 8, quick 2)")
    p.add_argument("--samples", type=positive_int, default=None, help="training samples per scenario")
    p.add_argument("--scenarios", default=None, help=f"comma-separated among {[s.name for s in SCENARIOS]}")
