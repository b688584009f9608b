"""``module:function`` datasets and models for the population CLI tests (importable by workers)."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from partrain.models import mlp


def _blobs(n: int = 200, features: int = 6, classes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    centers = 3 * torch.randn(classes, features, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return centers[y] + torch.randn(n, features, generator=g), y


def blobs() -> TensorDataset:
    """200 samples of 6 features in 3 classes (a TensorDataset: split by partrain)."""
    return TensorDataset(*_blobs())


class Pairs(Dataset):
    """The same blobs as a plain Dataset of (input, label) pairs (read sample by sample)."""

    def __init__(self) -> None:
        self.x, self.y = _blobs()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


def pairs() -> Dataset:
    return Pairs()


def regression() -> TensorDataset:
    """Float targets: a regression task, which population refuses."""
    x, _ = _blobs()
    return TensorDataset(x, x.sum(1))


class Dicts(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.zeros(6), "y": torch.tensor(0)}


def dicts() -> Dataset:
    return Dicts()


class FailsOnRank1(nn.Module):
    """An MLP whose forward raises on process 1 from its 3rd training call: a failure of one process."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp(in_features=64, hidden=8, depth=1)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and os.environ.get("RANK") == "1":
            self.calls += 1
            if self.calls >= 3:
                raise RuntimeError("member forward failed on purpose on process 1")
        return self.net(x)


def fails_on_rank1() -> nn.Module:
    return FailsOnRank1()
