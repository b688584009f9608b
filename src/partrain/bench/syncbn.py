"""SyncBatchNorm vs plain BatchNorm: step time of a BN-CNN under allreduce (DDP), 2 workers.

Every variant trains the same model (partrain.models.bn_cnn) on the same
synthetic batches in the same launched job: plain ``nn.BatchNorm2d`` (each
worker normalises with its own batch statistics - the baseline a user has),
``partrain.nn.SyncBatchNorm`` (statistics of the global batch) and
``torch.nn.SyncBatchNorm`` where it runs (it refuses CPU tensors: "n/a on CPU").
A step is forward + backward (DDP all-reduce included) + SGD step. Variants
take turns in alternating rounds so that load from other processes hits all of
them alike; a round's figure is the slowest worker's mean step time (a
synchronous step goes at the pace of the slowest worker), tables show the median
over rounds with its min-max spread. A second table times one BatchNorm layer
alone (forward + backward), where the extra collectives are not hidden behind
convolutions.

Goal: syncbn.step_ratio (partrain.nn.SyncBatchNorm / plain BatchNorm, step
time, round by round) <= 1.3.
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..launch import launch
from ..models import bn_cnn
from ..nn import convert_sync_batchnorm
from .harness import Report, Spread, alternate, paired_ratio, pick_size, positive_int

VARIANTS = ("plain", "partrain", "torch")
LABELS = {"plain": "nn.BatchNorm2d (local stats)", "partrain": "partrain.nn.SyncBatchNorm",
          "torch": "torch.nn.SyncBatchNorm"}



@dataclass(frozen=True)
class Size:
    batch: int  # samples per worker per step
    image_size: int
    width: int  # channels of the first convolution
    steps: int  # timed steps per round
    rounds: int


FULL = Size(batch=32, image_size=16, width=32, steps=60, rounds=7)
QUICK = Size(batch=32, image_size=16, width=32, steps=5, rounds=3)
TOY = Size(batch=4, image_size=8, width=4, steps=1, rounds=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=positive_int, default=None, help="samples per worker per step (default 32)")
    parser.add_argument("--image-size", type=positive_int, default=None, help="square image side (default 16)")
    parser.add_argument("--width", type=positive_int, default=None, help="channels of the first convolution (default 32)")
    parser.add_argument("--steps", type=positive_int, default=None, help="timed steps per round (default 60, quick 5)")
    parser.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 7, quick 3)")
    parser.add_argument("--workers", type=positive_int, default=2, help="worker processes (default 2)")


def _variant_model(kind: str, image_size: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = bn_cnn(in_channels=3, num_classes=10, image_size=image_size, width=width)
    if kind == "partrain":
        model = convert_sync_batchnorm(model)
    elif kind == "torch":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: a clock read must wait for them
        torch.cuda.synchronize(device)


def _time_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                steps: int) -> float:
    _synchronize(x.device)
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    _synchronize(x.device)
    return (time.perf_counter() - start) / steps


def _time_layer(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, steps: int) -> float:
    _synchronize(x.device)
    start = time.perf_counter()
    for _ in range(steps):
        xi = x.detach().requires_grad_()
        layer(xi).backward(g)
    _synchronize(x.device)
    return (time.perf_counter() - start) / steps


def _worker(strategy: Any, batch: int, image_size: int, width: int, steps: int, rounds: int) -> dict[str, Any]:
    device = strategy.device
    g = torch.Generator().manual_seed(1 + strategy.rank)
    x = torch.randn(batch, 3, image_size, image_size, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)

    runs: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    for kind in VARIANTS:
        model = _variant_model(kind, image_size, width)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        try:
            model, opt = strategy.prepare(model, opt)
            _time_steps(model, opt, x, y, 2)  # warm-up (and: does it run here at all?)
        except (ValueError, RuntimeError) as exc:  # torch.nn.SyncBatchNorm refuses CPU modules
            unavailable[kind] = f"n/a on {device.type.upper()}" if device.type == "cpu" else f"n/a: {exc}"
            continue
        runs[kind] = (model, opt)

    # one layer alone: the second BatchNorm of the model, on its activation's shape
    channels = 2 * width
    layer_input = torch.randn(batch, channels, image_size, image_size, generator=g).to(device)
    layer_grad = torch.randn(batch, channels, image_size, image_size, generator=g).to(device)
    layers = {"plain": nn.BatchNorm2d(channels).to(device)}
    layers["partrain"] = convert_sync_batchnorm(nn.BatchNorm2d(channels)).to(device)
    if "torch" in runs:
        layers["torch"] = nn.SyncBatchNorm(channels).to(device)
    for layer in layers.values():
        _time_layer(layer, layer_input, layer_grad, 2)

    def in_step(measure: Any) -> float:
        strategy.barrier()  # every worker starts the variant together: its collectives pair up
        return measure()

    # the turn order is the same on every worker (alternate is deterministic): collectives match
    step_timers = {kind: functools.partial(_time_steps, model, opt, x, y, steps) for kind, (model, opt) in runs.items()}
    layer_timers = {kind: functools.partial(_time_layer, module, layer_input, layer_grad, steps)
                    for kind, module in layers.items()}
    times = alternate({kind: functools.partial(in_step, timer) for kind, timer in step_timers.items()}, rounds)
    layer_times = alternate({kind: functools.partial(in_step, timer) for kind, timer in layer_timers.items()}, rounds)
    return {"times": times, "layer_times": layer_times, "unavailable": unavailable, "device": device.type}


def run(args: argparse.Namespace) -> Report:
    size, smoke = pick_size(args, FULL, QUICK, TOY)
    batch = args.batch or size.batch
    image_size = args.image_size or size.image_size
    width = args.width or size.width
    steps = args.steps or size.steps
    rounds = args.rounds or size.rounds
    report = Report("syncbn", smoke=smoke)
    results = launch(_worker, batch, image_size, width, steps, rounds,
                     workers=args.workers, strategy="allreduce", timeout=120)

    def slowest_worker(key: str, kind: str) -> list[float]:
        # per round, the slowest worker sets the pace of a synchronous step
        return [max(ts) for ts in zip(*(r[key][kind] for r in results))]

    device = results[0]["device"]
    report.say(f"partrain bench syncbn: bn_cnn(width={width}), {args.workers} workers x {batch} samples "
               f"of 3x{image_size}x{image_size}, allreduce (DDP), {device}, {rounds} alternating rounds x "
               f"{steps} steps")
    step_ratio = Spread.of([])
    for title, key, prefix in (("train step (forward + backward + SGD step)", "times", "step"),
                               (f"one BatchNorm layer, {2 * width} channels (forward + backward)",
                                "layer_times", "layer")):
        rows = []
        base = slowest_worker(key, "plain")
        for kind in VARIANTS:
            if kind not in results[0][key]:
                rows.append([LABELS[kind], results[0]["unavailable"].get(kind, "n/a"), "n/a"])
                continue
            times = slowest_worker(key, kind)
            ms = Spread.of([t * 1e3 for t in times])
            ratio = paired_ratio(times, base)
            report.figure(f"{prefix}_ms_{kind}", ms)
            report.figure(f"{prefix}_ratio_{kind}_vs_plain", ratio)
            rows.append([LABELS[kind], ms.cell(), ratio.cell()])
            if (prefix, kind) == ("step", "partrain"):
                step_ratio = ratio
        report.table(["variant", "ms median (min-max)", "x plain"], rows, title=title)
    report.goal("syncbn.step_ratio", step_ratio.median, "<=", 1.3,
                "partrain.nn.SyncBatchNorm / plain BatchNorm, step time")
    return report
