"""User-side factories for `module:function` specs in the CLI tests."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def tiny_dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 6, generator=g)
    y = (x[:, 0] > 0).long()
    return TensorDataset(x, y)


def tiny_model():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def wrong_model():
    return nn.Linear(99, 2)


def tiny_regression():
    """One Dataset with float targets: y = x @ w + 0.5 (fit holds a share out for testing)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(150, 6, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -1.0]) + 0.5
    return TensorDataset(x, y)


def tiny_regressor():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))


def _count(what: str) -> None:
    """Appends ``what`` to the file $PARTRAIN_TEST_COUNTS names (every process of a run writes there)."""
    import os

    with open(os.environ["PARTRAIN_TEST_COUNTS"], "a") as f:
        f.write(what + "\n")


def counting_dataset():
    _count("data")
    return tiny_dataset()


def counting_model():
    _count("model")
    return tiny_model()


def missing_file_dataset():
    """A user's dataset function that fails the way a wrong path does."""
    raise FileNotFoundError("no such file: my_data.bin")


class FailsInWorkers(nn.Module):
    """Trains in the caller's checks; fails in a worker's forward (a bug that shows only there)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(6, 2)

    def forward(self, x):
        if torch.distributed.is_initialized():
            raise RuntimeError("a bug in my forward")
        return self.layer(x)


def fails_in_workers():
    return FailsInWorkers()
