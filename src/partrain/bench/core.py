"""Core: fit() against a hand-written loop and a raw DistributedDataParallel script, plus 1->2 worker scaling.

Four ways to train the same model on the same data, in one run:

(a) a plain hand-written PyTorch loop in one process,
(b) ``fit`` with ``single``,
(c) a raw DistributedDataParallel script with 2 processes (what a user writes by hand),
(d) ``fit`` with ``allreduce`` and 2 workers,

and a compute-bound configuration trained by ``fit``/``allreduce`` with 1 then
2 workers (one thread each), next to one process using every core (what a
user gets without partrain). Rates are the best epoch of several (steady state:
process start-up and the first epoch's warm-up are excluded for every variant).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..data.datasets import synthetic
from ..models import cnn
from ..train.loop import fit
from .common import format_table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=int, default=None, help="training samples (default 12288, quick 4096)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per variant (default 5, quick 3)")
    p.add_argument("--batch-size", type=int, default=64, help="per-worker batch size")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds per pair (default 3, quick 2)")


def _data(samples: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    train, _ = synthetic(samples=samples, shape=(1, size, size), classes=10, test_fraction=0.0, seed=0)
    return train.tensors[0], train.tensors[1]


def _model(width: int, size: int) -> torch.nn.Module:
    return cnn(in_channels=1, num_classes=10, image_size=size, width=width)


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _hand_epochs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, epochs: int,
                 rank: int = 0, world: int = 1) -> list[float]:
    """The loop a user writes: shuffle, slice this rank's part, forward, backward, step."""
    opt = _opt(model.parameters())
    rates = []
    for epoch in range(epochs):
        g = torch.Generator().manual_seed(epoch)
        perm = torch.randperm(len(x), generator=g)
        t0 = time.perf_counter()
        n = 0
        for start in range(0, len(x), batch * world):
            idx = perm[start : start + batch * world][rank::world]
            xb, yb = x.index_select(0, idx), y.index_select(0, idx)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            n += len(idx)
        rates.append(n * world / (time.perf_counter() - t0))
    return rates


def _raw_ddp_worker(rank: int, world: int, store_path: str, cfg: dict, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        x, y = _data(cfg["samples"], cfg["size"])
        torch.manual_seed(0)
        model = DistributedDataParallel(_model(cfg["width"], cfg["size"]))
        rates = _hand_epochs(model, x, y, cfg["batch"], cfg["epochs"], rank, world)
        if rank == 0:
            out.put(rates)
    finally:
        dist.destroy_process_group()


def raw_ddp(cfg: dict, world: int = 2) -> float:
    """Best epoch samples/s of a hand-written DDP script with ``world`` processes."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_raw_ddp_worker, args=(r, world, os.path.join(tmp, "store"), cfg, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            rates = out.get(timeout=600)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.exitcode is None:
                    p.kill()
    return max(rates[1:] or rates)


def fit_rate(cfg: dict, strategy: str, workers: int, threads: int | None = None) -> float:
    data = (torch.utils.data.TensorDataset(*_data(cfg["samples"], cfg["size"])), None)
    res = fit(functools.partial(_model, cfg["width"], cfg["size"]), data, _opt, strategy=strategy, workers=workers,
              epochs=cfg["epochs"], batch_size=cfg["batch"], quiet=True, checkpoint=False, threads=threads,
              timeout=600)
    rates = [r["samples_per_s"] for r in res.history]
    return max(rates[1:] or rates)


def run(args: argparse.Namespace) -> dict[str, float]:
    samples = args.samples or (4096 if args.quick else 12288)
    epochs = args.epochs or (3 if args.quick else 5)
    cores = os.cpu_count() or 1
    base = {"samples": samples, "epochs": epochs, "batch": args.batch_size, "width": 16, "size": 16}
    heavy = {**base, "width": 48, "batch": 128}

    # Each pair is measured in alternating rounds and each variant keeps its best round:
    # on a shared machine, noise only ever slows a variant down.
    rounds = args.rounds or (2 if args.quick else 3)
    x, y = _data(samples, base["size"])
    a = b = c = d = one = two = 0.0
    for _ in range(rounds):
        a = max(a, max(_hand_epochs(_model(base["width"], base["size"]), x, y, base["batch"], epochs)[1:]))
        b = max(b, fit_rate(base, "single", 1))
    for _ in range(rounds):
        c = max(c, raw_ddp(base))
        d = max(d, fit_rate(base, "allreduce", 2))
    one_two_threads = 0.0
    for _ in range(rounds):
        one = max(one, fit_rate(heavy, "allreduce", 1, threads=1))
        two = max(two, fit_rate(heavy, "allreduce", 2, threads=1))
        one_two_threads = max(one_two_threads, fit_rate(heavy, "single", 1, threads=cores))

    figures = {
        "plain_loop_samples_per_s": a, "fit_single_samples_per_s": b,
        "raw_ddp_2proc_samples_per_s": c, "fit_allreduce_2w_samples_per_s": d,
        "heavy_1_worker_samples_per_s": one, "heavy_2_workers_samples_per_s": two,
        "heavy_1_process_all_cores_samples_per_s": one_two_threads,
        "ratio_2_workers_vs_1_process_all_cores": two / one_two_threads,
        "ratio_fit_single_vs_plain": b / a, "ratio_fit_allreduce_vs_raw_ddp": d / c, "scaling_1_to_2": two / one,
    }
    rows = [
        ["(a) plain PyTorch loop, 1 process", a, "", ""],
        ["(b) fit, single", b, b / a, ">= 0.98 x (a)"],
        ["(c) raw DDP script, 2 processes", c, "", ""],
        ["(d) fit, allreduce, 2 workers", d, d / c, ">= 0.98 x (c)"],
        ["compute-bound, allreduce, 1 worker", one, "", ""],
        ["compute-bound, allreduce, 2 workers", two, two / one, ">= 1.6 x (1 worker)"],
        [f"compute-bound, 1 process, {cores} threads", one_two_threads, two / one_two_threads,
         "(2 workers vs this)"],
    ]
    print(f"partrain bench core: {samples} samples of 1x16x16, {epochs} epochs x {rounds} rounds each, "
          f"batch {base['batch']}/worker, {cores} cores, torch {torch.__version__}")
    print(format_table(["variant", "samples/s", "ratio", "goal"], rows))
    return figures
