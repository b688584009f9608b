"""An LSTM on variable-length sequences, trained under all-reduce with 2 workers.

Each sample is a sequence of 3 to 40 steps of 4 features; the label says whether the
first feature's mean is positive. Batches are built by `partrain.data`:

- the training set is a `Sequences` (sequences with their lengths), so `fit` batches
  samples of similar length together (`BucketBatchSampler`: every sample once per
  epoch, sharded over the workers) and padding stays small;
- `PadCollate` pads a batch to its longest sequence and passes the lengths, so the model
  is called as ``model(x=padded, lengths=lengths)`` and packs the batch for the LSTM
  (the padding never enters the recurrence).

Run: ``python examples/lstm_variable_length.py`` (from the repository root).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from partrain import fit
from partrain.data import PadCollate, Sequences, pack

FEATURES = 4


class LstmClassifier(nn.Module):
    def __init__(self, hidden: int = 16, classes: int = 2) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(pack(x, lengths))  # the last real step of every sequence
        return self.head(h[-1])


def sequences(n: int, seed: int, dtype: torch.dtype = torch.float32) -> Sequences:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 41, (n,), generator=g)
    xs = [torch.randn(int(length), FEATURES, generator=g, dtype=dtype) for length in lengths]
    ys = torch.tensor([int(x[:, 0].mean() > 0) for x in xs])
    return Sequences(xs, ys)


def data(n: int = 600, dtype: torch.dtype = torch.float32) -> tuple[Sequences, Sequences]:
    """``(train, test)``: ``n`` training sequences and a fifth as many to test on."""
    return sequences(n, seed=0, dtype=dtype), sequences(n // 5, seed=1, dtype=dtype)


def main() -> None:
    result = fit(LstmClassifier, data, functools.partial(torch.optim.Adam, lr=0.01), strategy="allreduce",
                 workers=2, epochs=8, batch_size=16, collate_fn=PadCollate())
    print(f"test accuracy {result.test_accuracy:.3f}")


if __name__ == "__main__":
    main()
