"""Per-epoch metrics: the step-time breakdown, and where they are written.

Files on the main worker, in ``out_dir``: ``metrics.csv`` and ``metrics.jsonl``
(one row per epoch), ``curves.png`` (the loss and each of the task's metrics, train and
test), and with ``tensorboard`` event files in ``out_dir/tensorboard``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO


@dataclass
class StepTimes:
    """Seconds of one epoch spent waiting for data, computing, and waiting on communication.

    ``comm`` is *exposed* communication: time the loop was blocked on the network,
    as measured by the strategy (overlapped communication costs nothing and is not
    counted). ``compute`` is the rest of the step.
    """

    data: float = 0.0
    compute: float = 0.0
    comm: float = 0.0
    _mark: float = field(default=0.0, repr=False)

    def start(self) -> None:
        self._mark = time.perf_counter()

    def data_ready(self) -> None:
        now = time.perf_counter()
        self.data += now - self._mark
        self._mark = now

    def step_done(self, comm_seconds: float) -> None:
        now = time.perf_counter()
        self.comm += comm_seconds
        self.compute += max(0.0, now - self._mark - comm_seconds)
        self._mark = now

    def shares(self) -> dict[str, float]:
        total = self.data + self.compute + self.comm
        if total <= 0:
            return {"data": 0.0, "compute": 0.0, "comm": 0.0}
        return {"data": self.data / total, "compute": self.compute / total, "comm": self.comm / total}


class MetricsWriter:
    """Appends one row per epoch to CSV and JSONL, and redraws the curves."""

    def __init__(self, out_dir: str, resume: bool = False, tensorboard: bool = False) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                from .errors import UsageError

                raise UsageError("Expected the tensorboard package for tensorboard=True (pip install "
                                 f"'partrain[tensorboard]'). Received: {exc}") from None
            self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        self.out_dir = out_dir
        self.csv_path = os.path.join(out_dir, "metrics.csv")
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        if not resume:
            for p in (self.csv_path, self.jsonl_path):
                if os.path.exists(p):
                    os.unlink(p)

    def write(self, history: list[dict[str, Any]]) -> None:
        """Every file rewritten whole through a temporary file and a rename: a process stopped
        mid-write leaves the previous epoch's files, never a truncated one."""
        row = history[-1]
        with _replacing(self.jsonl_path) as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in history)
        keys = sorted({k for r in history for k in r})
        with _replacing(self.csv_path, newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for r in history:
                w.writerow(r)
        curves = os.path.join(self.out_dir, "curves.png")
        plot_curves(history, f"{curves}.tmp.png")
        os.replace(f"{curves}.tmp.png", curves)
        if self.tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("epoch", "workers"):
                    self.tb.add_scalar(_tb_tag(key), value, global_step=row["epoch"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


@contextlib.contextmanager
def _replacing(path: str, newline: str | None = None) -> Iterator[TextIO]:
    """A text file written to ``path.tmp``, renamed over ``path`` when the block ends."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", newline=newline) as f:
        yield f
    os.replace(tmp, path)


def _tb_tag(key: str) -> str:
    """``train_loss`` -> ``loss/train``; ``time_data`` -> ``time/data``."""
    for prefix in ("train_", "test_"):
        if key.startswith(prefix):
            return f"{key[len(prefix):]}/{prefix[:-1]}"
    head, sep, tail = key.partition("_")
    return f"{head}/{tail}" if sep else key


def plot_curves(history: list[dict[str, Any]], path: str) -> None:
    """The loss and each metric per epoch, train and test, to a PNG (one panel each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["loss"] + sorted({k[len("train_"):] for r in history for k in r
                               if k.startswith("train_") and k != "train_loss"})
    epochs = [r["epoch"] for r in history]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for split in ("train", "test"):
            values = [r.get(f"{split}_{name}", math.nan) for r in history]
            if any(v == v for v in values):
                ax.plot(epochs, values, marker="o", label=split)
        ax.set(title=name, xlabel="epoch")
        if name == "accuracy":
            ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
