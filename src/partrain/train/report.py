"""What a run shows: the epoch's row of figures, the epoch line, the progress bar."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..memory import summary as memory_summary

if TYPE_CHECKING:
    from .epoch import EpochTotals
    from .trainer import Trainer


def epoch_row(trainer: Trainer, epoch: int, step: int, totals: EpochTotals, reduced: torch.Tensor,
              test_loss: float, test_metrics: dict[str, float]) -> dict[str, Any]:
    """The epoch's figures from the training sums ``reduced`` over workers (`Trainer.record`'s row)."""
    strategy, task = trainer.strategy, trainer.task
    train = reduced
    w = strategy.num_workers
    seconds = totals.seconds
    m = len(task.metric_names)
    loss, metrics = task.means(train[0].item(), train[7].item(), train[1].item(), train[8:8 + m].tolist())
    row: dict[str, Any] = {"epoch": epoch + 1, "step": step, "train_loss": loss}
    row.update({f"train_{name}": value for name, value in metrics.items()})
    row["test_loss"] = test_loss
    row.update({f"test_{name}": value for name, value in test_metrics.items()})
    row.update({
        "samples": int(train[1].item()),
        "seconds": seconds,
        "samples_per_s": train[1].item() / seconds if seconds > 0 else math.nan,
        **({"tokens": int(train[7].item()), "tokens_per_s": train[7].item() / seconds if seconds > 0 else math.nan}
           if task.units != "samples" else {}),
        "time_data": train[2].item() / w,
        "time_compute": train[3].item() / w,
        "time_comm": train[4].item() / w,
        "comm_bytes": int(train[5].item()),
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "workers": w,
        "strategy": strategy.name,
        "loader": trainer.feeder.describe() if trainer.feeder is not None else "inline",
    })
    if trainer.tuned:
        row["loader_tuned"] = trainer.tuned
    if trainer.compile_seconds is not None:
        row["compile_seconds"] = trainer.compile_seconds
        row["compiled"] = "step" if trainer.fused is not None else "forward"
    if strategy.device.type == "cuda":
        row["device_utilization"] = utilization(strategy.device)
    if trainer.cfg.on_nan == "skip":
        row["skipped_steps"] = int(train[6].item())
    row.update({f"{strategy.name}_{k}": v for k, v in strategy.metrics().items()})
    return row


def progress(total: int, epoch: int, epochs: int):  # noqa: ANN201
    from tqdm import tqdm

    return tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", leave=False, dynamic_ncols=True)


def summary(row: dict[str, Any], epochs: int, has_test: bool = True) -> str:
    """The epoch line: losses, the task's metrics (on the test set too when there is one),
    throughput and the step-time breakdown."""
    t = row["time_data"] + row["time_compute"] + row["time_comm"]
    share = (lambda v: 100 * v / t) if t > 0 else (lambda v: 0.0)
    metric_names = [k[len("train_"):] for k in row if k.startswith("train_") and k != "train_loss"]

    def figures(split: str) -> str:
        parts = [f"{split + '_' if split == 'test' else ''}loss {row[f'{split}_loss']:.4f}"]
        for name in metric_names:
            label = {"accuracy": "acc", "perplexity": "ppl", "token_accuracy": "token_acc"}.get(name, name)
            value = row.get(f"{split}_{name}", math.nan)
            digits = 3 if name == "accuracy" else 2 if name == "perplexity" else 4
            parts.append(f"{split + '_' if split == 'test' else ''}{label} {value:.{digits}f}")
        return "  ".join(parts)

    skipped = f"  skipped {row['skipped_steps']} steps" if row.get("skipped_steps") else ""
    util = row.get("device_utilization")
    device = f" gpu {util:.0f}%" if isinstance(util, (int, float)) and util == util else ""
    test = f"{figures('test')}  " if has_test else ""
    return (f"epoch {row['epoch']}/{epochs}  {figures('train')}  {test}"
            f"{row['samples_per_s']:,.0f} samples/s  "
            f"{format(row['tokens_per_s'], ',.0f') + ' tokens/s  ' if 'tokens_per_s' in row else ''}"
            f"[data {share(row['time_data']):.0f}% compute {share(row['time_compute']):.0f}% "
            f"comm {share(row['time_comm']):.0f}%{device}]{memory_summary(row)}{skipped}"
            f"{_input_bound(row, share(row['time_data']))}")


def _input_bound(row: dict[str, Any], data_percent: float) -> str:
    """The epoch line's note when waiting for data took more than `INPUT_BOUND` of the time."""
    from ..data.pipeline import INPUT_BOUND

    if data_percent <= 100 * INPUT_BOUND:
        return ""
    tuned = row.get("loader_tuned")
    advice = (f"{tuned} for the next epoch" if tuned else
              "more --loader-workers / --prefetch, or another --loader (docs/data.md)")
    return f"  input-bound (loader {row.get('loader', '?')}: {advice})"


def utilization(device: torch.device) -> float:
    """The device's utilisation in percent over the last sample period (NVML), NaN when unknown."""
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # no NVML (pynvml) or no permission: the breakdown stays without it
        return math.nan
