"""Async: allreduce vs ps (staleness 0, 2, inf), hogwild and localsgd/DiLoCo, with and without a straggler.

One run, one model (the small CNN), one synthetic task (Gaussian clusters in
8x8 images, noisy enough that accuracy climbs over several epochs), every
variant trained by the same ``partrain.fit`` loop with 2 workers of one
thread each:

- ``allreduce`` (the baseline every ratio is taken against, in the same
  straggler setting), ``ps`` with staleness 0, 2 and inf (1 server),
  ``hogwild``, ``localsgd`` with period H (default 8) with and without the
  outer Nesterov optimizer (DiLoCo; outer lr 0.8, momentum 0.3 at this short
  period), and DiLoCo with a long period (default 64, DiLoCo's own outer lr
  0.7 and momentum 0.9: the bytes a long period saves, as DiLoCo is meant
  to be used);
- each again with a straggler: worker 0 sleeps, before every training step,
  as long as its previous step's forward and backward took (it runs at half
  speed);
- ``hogwild`` with one process (one thread): the baseline of hogwild's scaling.

Figures per variant: samples/s (training time only, epochs after the first),
training seconds until the test accuracy first reaches ``--target`` (checked
at epoch ends), communicated bytes per training sample (all workers), and the
final test loss; ratios against allreduce. Timings are noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..models import cnn
from ..train.loop import fit
from .common import format_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=int, default=None, help="training samples (default 8192, quick 4096)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per variant (default 6, quick 3)")
    p.add_argument("--batch-size", type=int, default=32, help="per-worker batch size")
    p.add_argument("--target", type=float, default=0.85, help="test accuracy for time-to-target")
    p.add_argument("--period", type=int, default=8, help="localsgd/DiLoCo period H")
    p.add_argument("--long-period", type=int, default=64, help="DiLoCo's long period (0: skip the row)")
    p.add_argument("--straggler", choices=("both", "off", "on"), default="both",
                   help="run without and with a worker slowed 2x (default both)")


# ----- the task ---------------------------------------------------------------------
def make_data(samples: int, seed: int = 0, noise: float = 2.0) -> tuple[TensorDataset, TensorDataset]:
    """Ten Gaussian clusters in 8x8 images, noisy enough that accuracy climbs over epochs (to ~0.92)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, 1, 8, 8, generator=g)
    n = samples + samples // 4
    y = torch.randint(0, 10, (n,), generator=g)
    x = centers[y] + noise * torch.randn(n, 1, 8, 8, generator=g)
    return TensorDataset(x[:samples], y[:samples]), TensorDataset(x[samples:], y[samples:])


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


class Straggler(nn.Module):
    """Runs ``inner`` at half speed: before each training forward it sleeps as long as
    the previous step's forward and backward took (measured from the forward's start to
    the last gradient's accumulation)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self._start: float | None = None
        self._grads_done: float | None = None
        for p in inner.parameters():
            p.register_post_accumulate_grad_hook(self._grad_done)

    def _grad_done(self, _: torch.Tensor) -> None:
        self._grads_done = time.perf_counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if self._start is not None and self._grads_done is not None and self._grads_done > self._start:
                time.sleep(self._grads_done - self._start)
            self._start = time.perf_counter()
        return self.inner(x)


def bench_model(straggle: bool = False, workers: int = 2) -> nn.Module:
    """The small CNN; wrapped in `Straggler` on worker 0.

    Worker 0, because `fit` times an epoch on worker 0: with the straggler there, an
    epoch's seconds are the slowest worker's, i.e. the time the epoch really took
    (every worker has the same share of the data, and the epoch ends with a collective).
    Servers, when there are any, are the first ranks: worker 0 is rank world - workers.
    """
    model = cnn(in_channels=1, num_classes=10, image_size=8, width=16)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if straggle and world > 1 and int(os.environ.get("RANK", "0")) == world - workers:
        return Straggler(model)
    return model


# ----- one variant ------------------------------------------------------------------
def _train(strategy: str, options: dict[str, Any], workers: int, data: Any, args: argparse.Namespace,
           epochs: int, straggle: bool) -> dict[str, float]:
    from ..strategies import get_strategy

    model_fn = functools.partial(bench_model, straggle, workers)
    kwargs: dict[str, Any] = dict(strategy=get_strategy(strategy, **options), workers=workers, epochs=epochs,
                                  batch_size=args.batch_size, quiet=True, checkpoint=False, timeout=120,
                                  threads=1)
    threads = torch.get_num_threads()
    if workers == 1:
        torch.set_num_threads(1)  # one process runs in this one: give it one thread like each worker
    try:
        res = fit(model_fn, data, _optimizer, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert res is not None
    hist = res.history
    steady = hist[1:] if len(hist) > 1 else hist
    samples = sum(r["samples"] for r in steady)
    seconds = sum(r["seconds"] for r in steady)
    to_target, elapsed = math.nan, 0.0
    for r in hist:
        elapsed += r["seconds"]
        if r["test_accuracy"] >= args.target:
            to_target = elapsed
            break
    return {
        "samples_per_s": samples / seconds if seconds > 0 else math.nan,
        "time_to_target": to_target,
        "bytes_per_sample": sum(r["comm_bytes"] for r in hist) / max(1, sum(r["samples"] for r in hist)),
        "final_test_loss": hist[-1]["test_loss"],
        "final_test_accuracy": hist[-1]["test_accuracy"],
    }


def _variants(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    h = args.period
    out = [
        ("allreduce", "allreduce", {}),
        ("ps s=0", "ps", {"staleness": 0}),
        ("ps s=2", "ps", {"staleness": 2}),
        ("ps s=inf", "ps", {"staleness": math.inf}),
        ("hogwild", "hogwild", {}),
        (f"localsgd H={h}", "localsgd", {"period": h}),
        # a short period wants little outer momentum (0.9 overshoots at H=8 on this task)
        (f"diloco H={h}", "localsgd", {"period": h, "outer": "nesterov", "outer_lr": 0.8, "outer_momentum": 0.3}),
    ]
    if args.long_period:
        out.append((f"diloco H={args.long_period}", "localsgd", {"period": args.long_period, "outer": "nesterov"}))
    return out


def _key(label: str, straggle: bool) -> str:
    name = label.replace(" ", "_").replace("=", "")
    return f"{name}{'_straggler' if straggle else ''}"


def run(args: argparse.Namespace) -> dict[str, float]:
    samples = args.samples or (4096 if args.quick else 8192)
    epochs = args.epochs or (3 if args.quick else 6)
    data = make_data(samples)
    settings = {"both": [False, True], "off": [False], "on": [True]}[args.straggler]
    print(f"async: {samples} samples of 8x8 (10 noisy clusters), CNN, batch {args.batch_size} per worker, "
          f"{epochs} epochs, 2 workers x 1 thread, target test accuracy {args.target:g}", flush=True)

    figures: dict[str, float] = {}
    results: dict[tuple[str, bool], dict[str, float]] = {}
    single = _train("hogwild", {}, 1, data, args, epochs, False)
    for k, v in single.items():
        figures[f"hogwild_1proc_{k}"] = v
    for straggle in settings:
        for label, name, options in _variants(args):
            try:
                r = _train(name, options, 2, data, args, epochs, straggle)
            except Exception as exc:  # a strategy that is missing or broken: say so, run the rest
                print(f"{label}{' +straggler' if straggle else ''}: not available ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''})", flush=True)
                continue
            results[(label, straggle)] = r
            print(f"  {label}{' +straggler' if straggle else ''}: {r['samples_per_s']:,.0f} samples/s, "
                  f"target after {r['time_to_target']:.2f} s, test accuracy {r['final_test_accuracy']:.3f}",
                  file=sys.stderr, flush=True)
            for k, v in r.items():
                figures[f"{_key(label, straggle)}_{k}"] = v

    headers = ["variant", "straggler", "samples/s", "x allreduce", "s to target", "x allreduce",
               "bytes/sample", "x fewer", "test loss", "x allreduce", "test acc"]
    rows: list[list[Any]] = [["hogwild 1 process", "no", single["samples_per_s"], math.nan,
                              single["time_to_target"], math.nan, 0.0, math.nan, single["final_test_loss"],
                              math.nan, single["final_test_accuracy"]]]
    for straggle in settings:
        base = results.get(("allreduce", straggle))
        for label, _, _ in _variants(args):
            r = results.get((label, straggle))
            if r is None:
                rows.append([label, "yes" if straggle else "no", "not available"] + [math.nan] * 8)
                continue
            ratios = _ratios(r, base)
            for k, v in ratios.items():
                figures[f"{_key(label, straggle)}_{k}"] = v
            rows.append([label, "yes" if straggle else "no", r["samples_per_s"], ratios["speed_vs_allreduce"],
                         r["time_to_target"], ratios["time_to_target_vs_allreduce"], r["bytes_per_sample"],
                         ratios["bytes_fewer_than_allreduce"], r["final_test_loss"], ratios["loss_vs_allreduce"],
                         r["final_test_accuracy"]])
    print(format_table(headers, rows))

    hog = results.get(("hogwild", False))
    if hog is not None:
        figures["hogwild_scaling_2_workers_vs_1_process"] = hog["samples_per_s"] / single["samples_per_s"]
        print(f"hogwild scaling, 2 workers vs 1 process: "
              f"{figures['hogwild_scaling_2_workers_vs_1_process']:.2f}x samples/s (goal >= 1.7x)")
    if True in settings:
        ps_ratios = [figures.get(f"{_key(lbl, True)}_time_to_target_vs_allreduce", math.nan)
                     for lbl in ("ps s=2", "ps s=inf")]
        best = min((v for v in ps_ratios if not math.isnan(v)), default=math.nan)
        figures["straggler_best_ps_time_to_target_vs_allreduce"] = best
        print(f"with the straggler, best ps (s=2 or inf) time to target vs allreduce: {best:.2f}x (goal <= 0.7x)")
    for label, _, _ in _variants(args)[5:]:
        key = _key(label, False)
        if f"{key}_bytes_fewer_than_allreduce" in figures:
            print(f"{label}: {figures[f'{key}_bytes_fewer_than_allreduce']:.1f}x fewer bytes than allreduce, "
                  f"final test loss {figures[f'{key}_loss_vs_allreduce']:.3f}x allreduce's "
                  f"(goal >= 50x fewer, within 2%)")
    return figures


def _ratios(r: dict[str, float], base: dict[str, float] | None) -> dict[str, float]:
    if base is None:
        return dict.fromkeys(("speed_vs_allreduce", "time_to_target_vs_allreduce", "bytes_fewer_than_allreduce",
                              "loss_vs_allreduce"), math.nan)

    def div(a: float, b: float) -> float:
        return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan

    return {
        "speed_vs_allreduce": div(r["samples_per_s"], base["samples_per_s"]),
        "time_to_target_vs_allreduce": div(r["time_to_target"], base["time_to_target"]),
        "bytes_fewer_than_allreduce": div(base["bytes_per_sample"], r["bytes_per_sample"]),
        "loss_vs_allreduce": div(r["final_test_loss"], base["final_test_loss"]),
    }
