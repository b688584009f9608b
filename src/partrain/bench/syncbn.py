"""SyncBatchNorm vs plain BatchNorm: step time of a BN-CNN under allreduce (DDP), 2 workers.

Every variant trains the same model (partrain.models.bn_cnn) on the same
synthetic batches in the same launched job: plain ``nn.BatchNorm2d`` (each
worker normalises with its own batch statistics - the baseline a user has),
``partrain.nn.SyncBatchNorm`` (statistics of the global batch) and
``torch.nn.SyncBatchNorm`` where it runs (it refuses CPU tensors: "n/a on CPU").
A step is forward + backward (DDP all-reduce included) + SGD step. Variants
take turns in rounds so that load from other processes hits all of them alike;
the figure is the median step time over rounds of the slowest worker. A second
table times one BatchNorm layer alone (forward + backward), where the extra
collectives are not hidden behind convolutions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..launch import launch
from ..models import bn_cnn
from ..nn import convert_sync_batchnorm
from .common import format_table

VARIANTS = ("plain", "partrain", "torch")
LABELS = {"plain": "nn.BatchNorm2d (local stats)", "partrain": "partrain.nn.SyncBatchNorm",
          "torch": "torch.nn.SyncBatchNorm"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=32, help="samples per worker per step (default 32)")
    parser.add_argument("--image-size", type=int, default=16, help="square image side (default 16)")
    parser.add_argument("--width", type=int, default=32, help="channels of the first convolution (default 32)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per round (default 10, quick 5)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds over the variants (default 7, quick 3)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")


def _variant_model(kind: str, image_size: int, width: int) -> nn.Module | None:
    torch.manual_seed(0)
    model = bn_cnn(in_channels=3, num_classes=10, image_size=image_size, width=width)
    if kind == "partrain":
        model = convert_sync_batchnorm(model)
    elif kind == "torch":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def _time_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - start) / steps


def _time_layer(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        xi = x.detach().requires_grad_()
        layer(xi).backward(g)
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
    c = 2 * width
    xl = torch.randn(batch, c, image_size, image_size, generator=g).to(device)
    gl = torch.randn(batch, c, image_size, image_size, generator=g).to(device)
    layers = {"plain": nn.BatchNorm2d(c).to(device)}
    layers["partrain"] = convert_sync_batchnorm(nn.BatchNorm2d(c)).to(device)
    if "torch" in runs:
        layers["torch"] = nn.SyncBatchNorm(c).to(device)
    for layer in layers.values():
        _time_layer(layer, xl, gl, 2)

    times: dict[str, list[float]] = {k: [] for k in runs}
    layer_times: dict[str, list[float]] = {k: [] for k in layers}
    for _ in range(rounds):
        for kind, (model, opt) in runs.items():
            strategy.barrier()
            times[kind].append(_time_steps(model, opt, x, y, steps))
        for kind, layer in layers.items():
            strategy.barrier()
            layer_times[kind].append(_time_layer(layer, xl, gl, steps))
    return {"times": times, "layer_times": layer_times, "unavailable": unavailable, "device": device.type}


def run(args: argparse.Namespace) -> dict[str, float]:
    steps = args.steps or (5 if args.quick else 10)
    rounds = args.rounds or (3 if args.quick else 7)
    results = launch(_worker, args.batch, args.image_size, args.width, steps, rounds,
                     workers=args.workers, strategy="allreduce", timeout=120)

    def per_round_max(key: str, kind: str) -> float:
        # the slowest worker sets the pace of a synchronous step
        per_worker = [r[key][kind] for r in results]
        return statistics.median(max(ts) for ts in zip(*per_worker))

    figures: dict[str, float] = {}
    device = results[0]["device"]
    print(f"SyncBatchNorm benchmark: bn_cnn(width={args.width}), {args.workers} workers x {args.batch} samples "
          f"of 3x{args.image_size}x{args.image_size}, allreduce (DDP), {device}, {rounds} rounds x {steps} steps")
    for title, key, prefix in (("train step (forward + backward + SGD step)", "times", "step"),
                               (f"one BatchNorm layer, {2 * args.width} channels (forward + backward)",
                                "layer_times", "layer")):
        rows = []
        base = per_round_max(key, "plain")
        for kind in VARIANTS:
            if kind in results[0][key]:
                t = per_round_max(key, kind)
                figures[f"{prefix}_ms_{kind}"] = t * 1e3
                figures[f"{prefix}_ratio_{kind}_vs_plain"] = t / base
                rows.append([LABELS[kind], t * 1e3, t / base])
            else:
                rows.append([LABELS[kind], results[0]["unavailable"].get(kind, "n/a"), "n/a"])
        print()
        print(title)
        print(format_table(["variant", "ms", "x plain"], rows))
    print(f"\ngoal: partrain.nn.SyncBatchNorm step <= 1.3x plain BatchNorm; "
          f"measured {figures['step_ratio_partrain_vs_plain']:.2f}x")
    return figures
