"""Async: allreduce vs ps (staleness 0, 2, inf), hogwild and localsgd/DiLoCo, with and without a straggler.

One model (the small CNN), one synthetic task (Gaussian clusters in 8x8 images,
noisy enough that accuracy climbs over several epochs), every variant trained by
the same ``partrain.fit`` loop with 2 workers of one thread each:

- ``allreduce`` (the baseline every ratio is taken against, in the same
  straggler setting), ``ps`` with staleness 0, 2 and inf (1 server process),
  with staleness 2 and inf and ``staleness_lr=True`` (each gradient's step divided
  by its staleness; s=inf in the straggler runs by default), and with staleness 2 and
  inf colocated (``colocate=True``: a server thread in each worker process, no server
  process; only with ``--variants``),
  ``hogwild``, ``localsgd`` with period H (default 8) with and without the
  outer Nesterov optimizer (DiLoCo; outer lr 0.8, momentum 0.3), and DiLoCo
  with a long period (default 64, the strategy's default outer lr 0.8 and
  momentum 0.3: the bytes a long period saves);
- each again with a straggler: worker 0 sleeps, before every training step,
  as long as its previous step's forward and backward took (it runs at half
  speed);
- ``hogwild`` with one process (one thread): the baseline of hogwild's scaling.

Every variant runs once per round, in alternating rounds. Figures per variant:
samples/s (training time only, epochs after the first), training seconds until
the test accuracy first reaches ``--target`` (evaluated at epoch ends, linear between
the two around the crossing: `seconds_to_accuracy`), communicated
bytes per training sample (all workers), and the final test loss; medians over
rounds, ratios against allreduce round by round.

By default a round runs only the variants the goals need (`GOAL_VARIANTS`);
``--variants all`` runs every one. The time-to-target columns name the target
and how many rounds reached it (a round that never did is left out of the median).

Goals: async.hogwild_scaling (hogwild 2 workers / 1 process, samples/s) >= 1.7;
async.ps_vs_allreduce (best ps / allreduce, samples/s, no straggler) >= 0.9;
async.ps_straggler_time (best ps with staleness 2 or inf / allreduce, time to
target, with the straggler) <= 0.8; async.diloco_bytes (allreduce bytes / DiLoCo
long-period bytes per sample) >= 50; async.diloco_loss (DiLoCo long-period final
test loss / allreduce's) <= 1.02.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..errors import UsageError
from ..models import cnn
from ..strategies import get_strategy
from ..train.fit import fit
from .harness import Report, Spread, alternate, paired_ratio, pick_size, positive_int

FIGURES = ("samples_per_s", "time_to_target", "bytes_per_sample", "final_test_loss", "final_test_accuracy")


@dataclass(frozen=True)
class Size:
    samples: int
    epochs: int
    rounds: int
    target: float  # test accuracy for time-to-target
    period: int  # localsgd / DiLoCo H
    long_period: int  # DiLoCo's long H (0: skip)


FULL = Size(samples=8192, epochs=4, rounds=3, target=0.85, period=8, long_period=64)
QUICK = Size(samples=4096, epochs=2, rounds=3, target=0.85, period=8, long_period=64)
# the toy's target is reached after the first epoch, so time-to-target is a number
TOY = Size(samples=512, epochs=2, rounds=1, target=0.0, period=2, long_period=4)


@dataclass(frozen=True)
class Variant:
    """One way to train: a strategy with its options, with or without the straggler."""

    key: str  # the --variants name
    label: str
    strategy: str
    options: dict[str, Any]
    workers: int = 2
    straggle: bool = False

    @property
    def name(self) -> str:
        return f"{self.label} +straggler" if self.straggle else self.label


def variants(period: int, long_period: int) -> list[Variant]:
    out = [
        Variant("allreduce", "allreduce", "allreduce", {}),
        Variant("ps-s0", "ps s=0", "ps", {"staleness": 0}),
        Variant("ps-s2", "ps s=2", "ps", {"staleness": 2}),
        # (not overlap=True: with it s=inf diverged here, test loss 6.3x allreduce's; see docs/strategies/ps.md)
        Variant("ps-sinf", "ps s=inf", "ps", {"staleness": math.inf}),
        # each gradient's learning rate divided by its staleness (a straggler's late gradients count less)
        Variant("ps-s2-slr", "ps s=2 staleness_lr", "ps", {"staleness": 2, "staleness_lr": True}),
        Variant("ps-sinf-slr", "ps s=inf staleness_lr", "ps", {"staleness": math.inf, "staleness_lr": True}),
        # colocated: each worker process runs a server thread for half the parameters, no server process
        Variant("ps-s2-co", "ps s=2 colocated", "ps", {"staleness": 2, "colocate": True}),
        Variant("ps-sinf-co", "ps s=inf colocated", "ps", {"staleness": math.inf, "colocate": True}),
        Variant("hogwild", "hogwild", "hogwild", {}),
        Variant("localsgd", f"localsgd H={period}", "localsgd", {"period": period}),
        # a short period wants little outer momentum (0.9 overshoots at H=8 on this task)
        Variant("diloco", f"diloco H={period}", "localsgd",
                {"period": period, "outer": "nesterov", "outer_lr": 0.8, "outer_momentum": 0.3}),
    ]
    if long_period:
        # the documented defaults (outer lr 0.8, momentum 0.3): tens of syncs per run
        out.append(Variant("diloco-long", f"diloco H={long_period}", "localsgd",
                           {"period": long_period, "outer": "nesterov"}))
    return out


HOGWILD_ONE_PROCESS = Variant("hogwild-1", "hogwild, 1 process", "hogwild", {}, workers=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=positive_int, default=None, help="training samples (default 8192, quick 4096)")
    p.add_argument("--epochs", type=positive_int, default=None, help="epochs per run, >= 2 (default 4, quick 2)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="per-worker batch size")
    p.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 3, quick 3)")
    p.add_argument("--target", type=float, default=None, help="test accuracy for time-to-target (default 0.85)")
    p.add_argument("--period", type=positive_int, default=None, help="localsgd/DiLoCo period H (default 8)")
    p.add_argument("--long-period", type=int, default=None, help="DiLoCo's long period (default 64; 0: skip)")
    p.add_argument("--straggler", choices=("both", "off", "on"), default="both",
                   help="run without and with a worker slowed 2x (default both)")
    p.add_argument("--variants", default=None,
                   help="comma-separated among allreduce, ps-s0, ps-s2, ps-sinf, ps-s2-slr, ps-sinf-slr, ps-s2-co, "
                        "ps-sinf-co, hogwild, "
                        "localsgd, diloco, "
                        "diloco-long, or all (default: those the goals need; allreduce always runs, it is the "
                        "baseline)")


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
                time.sleep(self._grads_done - self._start)  # the straggler's delay itself, not a wait on anything
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


# ----- one run of one variant -------------------------------------------------------
def train(variant: Variant, data: Any, epochs: int, batch_size: int, target: float) -> dict[str, float]:
    """Train ``variant`` once with ``partrain.fit``; its figures (`FIGURES`)."""
    result = fit(functools.partial(bench_model, variant.straggle, variant.workers), data, _optimizer,
                 strategy=get_strategy(variant.strategy, **variant.options), workers=variant.workers,
                 epochs=epochs, batch_size=batch_size, quiet=True, checkpoint=False, timeout=120, threads=1,
                 device="cpu")  # a benchmark of CPU processes, also on a machine with a GPU
    assert result is not None  # fit returns worker 0's result when it launched the workers
    history = result.history
    steady = history[1:] or history
    samples = sum(r["samples"] for r in steady)
    seconds = sum(r["seconds"] for r in steady)
    return {
        "samples_per_s": samples / seconds if seconds > 0 else math.nan,
        "time_to_target": seconds_to_accuracy(history, target),
        "bytes_per_sample": sum(r["comm_bytes"] for r in history) / max(1, sum(r["samples"] for r in history)),
        "final_test_loss": history[-1]["test_loss"],
        "final_test_accuracy": history[-1]["test_accuracy"],
    }


def seconds_to_accuracy(history: list[dict[str, float]], target: float) -> float:
    """Training seconds until the test accuracy first reaches ``target``: linear between the two
    epoch ends around the crossing (the first epoch's end when the first evaluation is already
    there, as nothing before it is measured); NaN if never.

    Read at epoch ends alone, every variant's time to the target fell on an epoch's end and
    ratios between variants moved in steps of whole epochs."""
    from ..compare.decide import time_to_reach

    ends = list(itertools.accumulate(r["seconds"] for r in history))
    errors = [-r["test_accuracy"] for r in history]  # a falling curve, as time_to_reach reads losses
    # the first evaluation repeated as the curve's start: reached there, its end counts
    return time_to_reach(ends[:1] + ends, errors[:1] + errors, -target)


def _unless_broken(run: Callable[[], dict[str, float]], name: str, report: Report) -> Callable[[], dict[str, float]]:
    """A variant that fails (a strategy missing or broken here) is reported once and skipped after."""
    failed: list[str] = []

    def measure() -> dict[str, float]:
        if not failed:
            try:
                return run()
            except Exception as exc:  # noqa: BLE001 - said in one line, the other variants go on
                failed.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                report.note(f"{name}: not available ({failed[0]})")
        return dict.fromkeys(FIGURES, math.nan)

    return measure


# the runs the goals need, per straggler setting: the default plan (--variants all: every variant)
GOAL_VARIANTS = {False: ("allreduce", "ps-s2", "ps-sinf", "hogwild", "diloco-long"),
                 True: ("allreduce", "ps-s2", "ps-sinf", "ps-sinf-slr")}


def _plan(args: argparse.Namespace, size: Size) -> list[Variant]:
    """The runs of one round: the chosen variants in the chosen straggler settings."""
    every = variants(size.period, size.long_period)
    if args.toy:
        # few launches for a smoke test: three goals measured, async.ps_straggler_time left
        # unmeasured (that path of the report runs too)
        return [v for v in every if v.key in ("allreduce", "hogwild", "diloco-long")]
    settings = {"both": [False, True], "off": [False], "on": [True]}[args.straggler]
    if not args.variants:
        return [replace(v, straggle=s) for s in settings for v in every if v.key in GOAL_VARIANTS[s]]
    chosen = [v.key for v in every]
    if args.variants != "all":
        chosen = [k.strip() for k in args.variants.split(",") if k.strip()]
        unknown = [k for k in chosen if k not in {v.key for v in every}]
        if unknown:
            raise UsageError(f"Expected --variants among {[v.key for v in every]}. Received: {unknown}")
        chosen = ["allreduce", *[k for k in chosen if k != "allreduce"]]
    return [replace(v, straggle=s) for s in settings for v in every if v.key in chosen]


def run(args: argparse.Namespace) -> Report:
    size, smoke = pick_size(args, FULL, QUICK, TOY)
    size = replace(size, **{k: v for k, v in (("samples", args.samples), ("epochs", args.epochs),
                                                ("rounds", args.rounds), ("target", args.target),
                                                ("period", args.period), ("long_period", args.long_period))
                            if v is not None})
    if size.epochs < 2:
        raise UsageError(f"Expected at least 2 epochs (the first is warm-up). Received: --epochs {size.epochs}")
    report = Report("async", smoke=smoke)
    data = make_data(size.samples)
    plan = [HOGWILD_ONE_PROCESS, *_plan(args, size)]
    report.say(f"partrain bench async: {size.samples} samples of 8x8 (10 noisy clusters), CNN, batch "
               f"{args.batch_size} per worker, {size.epochs} epochs per run, 2 workers x 1 thread, "
               f"{size.rounds} alternating rounds, target test accuracy {size.target:g}")

    def progress(r: int, name: str, f: dict[str, float]) -> None:
        report.progress(f"round {r + 1}: {name}: {f['samples_per_s']:,.0f} samples/s, target after "
                        f"{f['time_to_target']:.2f} s, test accuracy {f['final_test_accuracy']:.3f}")

    runs = alternate({v.name: _unless_broken(functools.partial(train, v, data, size.epochs, args.batch_size,
                                                               size.target), v.name, report) for v in plan},
                     size.rounds, on_result=progress)

    def figure(v: Variant, key: str) -> list[float]:
        return [r[key] for r in runs[v.name]]

    def against_allreduce(v: Variant) -> dict[str, Spread]:
        base = next((b for b in plan if b.key == "allreduce" and b.straggle == v.straggle), None)
        if base is None:
            return {}
        return {"speed_vs_allreduce": paired_ratio(figure(v, "samples_per_s"), figure(base, "samples_per_s")),
                "time_to_target_vs_allreduce": paired_ratio(figure(v, "time_to_target"),
                                                            figure(base, "time_to_target")),
                "bytes_fewer_than_allreduce": paired_ratio(figure(base, "bytes_per_sample"),
                                                           figure(v, "bytes_per_sample")),
                "loss_vs_allreduce": paired_ratio(figure(v, "final_test_loss"), figure(base, "final_test_loss"))}

    rows: list[list[Any]] = []
    ratios: dict[str, dict[str, Spread]] = {}
    for v in plan:
        spreads = {k: Spread.of(figure(v, k)) for k in FIGURES}
        ratios[v.name] = against_allreduce(v) if v.workers > 1 else {}
        for k, s in {**spreads, **ratios[v.name]}.items():
            report.figure(f"{_key(v.name)}_{k}", s)
        r = {k: s.median for k, s in ratios[v.name].items()}
        reached = sum(not math.isnan(t) for t in figure(v, "time_to_target"))
        report.figure(f"{_key(v.name)}_rounds_at_target", reached)
        rows.append([v.label, "yes" if v.straggle else "no", spreads["samples_per_s"].cell(),
                     r.get("speed_vs_allreduce", math.nan), spreads["time_to_target"].cell(),
                     f"{reached}/{size.rounds}",
                     r.get("time_to_target_vs_allreduce", math.nan), spreads["bytes_per_sample"].median,
                     r.get("bytes_fewer_than_allreduce", math.nan), spreads["final_test_loss"].median,
                     r.get("loss_vs_allreduce", math.nan), spreads["final_test_accuracy"].median])
    report.table(["variant", "straggler", "samples/s", "x allreduce", f"s to acc {size.target:g}", "rounds at it",
                  "x allreduce",
                  "bytes/sample", "x fewer", "test loss", "x allreduce", "test acc"], rows,
                 title="medians over rounds, (min-max) where rounds differ; ratios round by round")

    def find(key: str, straggle: bool) -> Variant | None:
        return next((v for v in plan if v.key == key and v.straggle == straggle), None)

    hogwild = find("hogwild", False)
    scaling = paired_ratio(figure(hogwild, "samples_per_s"),
                           figure(HOGWILD_ONE_PROCESS, "samples_per_s")).median if hogwild else None
    report.figure("hogwild_scaling_2_workers_vs_1_process", scaling if scaling is not None else math.nan)
    report.goal("async.hogwild_scaling", scaling, ">=", 1.7, "hogwild 2 workers / 1 process, samples/s")

    ps_keys = [v.key for v in variants(size.period, size.long_period) if v.strategy == "ps"]
    ps_speeds = [ratios[v.name]["speed_vs_allreduce"].median
                 for v in (find(k, False) for k in ps_keys) if v is not None]
    report.goal("async.ps_vs_allreduce", max((t for t in ps_speeds if not math.isnan(t)), default=None), ">=",
                0.9, "without a straggler: best ps / allreduce, samples/s")
    ps_times = [ratios[v.name]["time_to_target_vs_allreduce"].median  # asynchronous ones: s=2 or inf
                for v in (find(k, True) for k in ps_keys if k != "ps-s0") if v is not None]
    ps_best = min((t for t in ps_times if not math.isnan(t)), default=None)
    report.goal("async.ps_straggler_time", ps_best, "<=", 0.8,
                f"with the straggler: best ps (s=2 or inf) / allreduce, time to test accuracy {size.target:g}")

    diloco = find("diloco-long", False)
    diloco_ratios = ratios[diloco.name] if diloco is not None else {}
    label = diloco.label if diloco is not None else "diloco, long period"
    report.goal("async.diloco_bytes", _median(diloco_ratios.get("bytes_fewer_than_allreduce")), ">=", 50.0,
                f"allreduce / {label}, bytes per sample")
    report.goal("async.diloco_loss", _median(diloco_ratios.get("loss_vs_allreduce")), "<=", 1.02,
                f"{label} / allreduce, final test loss")
    return report


def _median(spread: Spread | None) -> float | None:
    return spread.median if spread is not None else None


def _key(name: str) -> str:
    return name.replace(" +", "_").replace(" ", "_").replace("=", "").replace(",", "")
