"""``partrain train``: the standard loop from the command line."""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

from torch import nn

from ..data.datasets import DataSpec, load_dataset, num_classes, sample_shape
from ..env import available_cores
from ..errors import UsageError
from ..models import MODELS, build_model, model_kwargs_for
from ..strategies.base import available, get_strategy, parse_options
from .checkpoint import load_checkpoint
from .optim import OPTIMIZERS, make_optimizer


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model under a parallel strategy (default: a CNN on the bundled digits)",
        description=(
            "Train a model with the standard loop under a strategy. With no arguments: a small CNN on "
            "scikit-learn's bundled handwritten digits, synchronous all-reduce on every core. "
            "Batch size is per worker; --scale-lr applies the linear scaling rule."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s = p.add_argument_group("strategy and processes")
    s.add_argument("--strategy", default="allreduce", metavar="NAME",
                   help=f"how gradients and parameters move: {', '.join(available())}")
    s.add_argument("-o", "--strategy-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a strategy option, repeatable (e.g. -o staleness=2 -o servers=2)")
    s.add_argument("--workers", type=int, default=None,
                   help="worker processes on this machine (default: one per core; 1 for 'single')")
    s.add_argument("--threads", type=int, default=None, help="intra-op threads per process (default: cores / processes)")
    s.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: gloo on CPU, nccl on CUDA")
    s.add_argument("--device", default="auto", help="cpu, cuda or auto")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds for rendezvous and every collective")
    s.add_argument("--nnodes", type=int, default=1, help="machines in the job (without torchrun)")
    s.add_argument("--node-rank", type=int, default=0, help="this machine's index (without torchrun)")
    s.add_argument("--master-addr", default=None, help="host of node 0 (without torchrun)")
    s.add_argument("--master-port", type=int, default=None, help="port on node 0 (without torchrun)")

    d = p.add_argument_group("model and data")
    d.add_argument("--model", default="cnn", help=f"one of {', '.join(MODELS)} or module:function")
    d.add_argument("--dataset", default="digits", help="digits, synthetic, a .npz file with x/y, or module:function")
    d.add_argument("--synthetic-samples", type=int, default=4096, help="samples of --dataset synthetic")
    d.add_argument("--synthetic-shape", default="1,8,8", help="sample shape of --dataset synthetic")
    d.add_argument("--synthetic-classes", type=int, default=10, help="classes of --dataset synthetic")
    d.add_argument("--test-fraction", type=float, default=0.2, help="held-out share for evaluation")
    d.add_argument("--sync-bn", action="store_true", help="convert BatchNorm layers to partrain's SyncBatchNorm")

    o = p.add_argument_group("optimization")
    o.add_argument("--epochs", type=int, default=8)
    o.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    o.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    o.add_argument("--lr", type=float, default=0.05)
    o.add_argument("--scale-lr", action="store_true", help="multiply lr by workers x accumulate (linear scaling rule)")
    o.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    o.add_argument("--momentum", type=float, default=0.9, help="for sgd")
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    o.add_argument("--seed", type=int, default=0)

    r = p.add_argument_group("output")
    r.add_argument("--out", default="runs/train", help="directory for metrics, curves and checkpoints")
    r.add_argument("--resume", default=None, metavar="PATH|auto",
                   help="continue from a checkpoint ('auto': OUT/checkpoint.pt when present)")
    r.add_argument("--quiet", action="store_true", help="no progress bar, no per-epoch lines")
    p.set_defaults(func=run)


def build_cli_model(name: str, kwargs: dict[str, Any], sync_bn: bool = False) -> nn.Module:
    """Model factory used in the workers (module-level so it pickles)."""
    model = build_model(name, **kwargs)
    if sync_bn:
        from ..nn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model)
    return model


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(v < 1 for v in shape):
        raise UsageError(f"Expected --synthetic-shape as positive integers separated by commas. Received: {text!r}")
    return shape


def run(args: argparse.Namespace) -> int:
    from .loop import check_model_takes, fit

    if args.workers is not None and args.workers < 1:
        raise UsageError(f"Expected a positive number of workers. Received: --workers {args.workers}")
    workers = args.workers or (1 if args.strategy == "single" else available_cores())
    options = parse_options(args.strategy, args.strategy_opt)
    strategy = get_strategy(args.strategy, **options)
    if not 0 < args.test_fraction < 1:
        raise UsageError(f"Expected 0 < --test-fraction < 1. Received: {args.test_fraction}")
    spec = DataSpec(name=args.dataset, samples=args.synthetic_samples, shape=_shape(args.synthetic_shape),
                    classes=args.synthetic_classes, test_fraction=args.test_fraction, seed=args.seed)
    train_ds, _ = load_dataset(spec)  # here first: bad data is one line before any process starts
    shape, classes = sample_shape(train_ds), num_classes(train_ds)
    kwargs = model_kwargs_for(args.model, shape, classes) if args.model in MODELS else {}
    model = build_cli_model(args.model, kwargs)
    check_model_takes(model, train_ds, f"model {args.model!r}", f"dataset {args.dataset!r}")
    optimizer_fn = functools.partial(make_optimizer, args.optimizer, lr=args.lr, momentum=args.momentum,
                                     weight_decay=args.weight_decay)
    optimizer_fn(model.parameters())  # bad optimizer settings: one line, before any process starts
    if args.sync_bn:
        build_cli_model(args.model, kwargs, sync_bn=True)  # fails here if the conversion cannot apply
    resume = args.resume
    if resume == "auto":
        candidate = os.path.join(args.out, "checkpoint.pt")
        resume = candidate if os.path.exists(candidate) else None
    if resume:
        ckpt = load_checkpoint(resume)
        spec_in = ckpt.get("model_spec") or {}
        if spec_in and spec_in.get("name") != args.model:
            raise UsageError(f"Expected --model {spec_in.get('name')!r} to resume {resume!r}. Received: --model {args.model!r}")

    result = fit(
        functools.partial(build_cli_model, args.model, kwargs, args.sync_bn),
        spec,
        optimizer_fn,
        strategy=strategy, workers=workers, epochs=args.epochs, batch_size=args.batch_size,
        accumulate=args.accumulate, scale_lr=args.scale_lr, out_dir=args.out, resume=resume, seed=args.seed,
        quiet=args.quiet, max_steps=args.max_steps, timeout=args.timeout, backend=args.backend,
        device=args.device, threads=args.threads,
        model_spec={"name": args.model, "kwargs": kwargs, "input_shape": list(shape), "num_classes": classes},
        **_multinode(args),
    )
    if result is not None and result.history:
        print(f"test accuracy: {result.test_accuracy:.4f}  ({args.strategy}, {workers} workers, "
              f"{len(result.history)} epochs; metrics, curves and checkpoint in {args.out})")
    return 0


def _multinode(args: argparse.Namespace) -> dict[str, Any]:
    if args.nnodes == 1 and args.master_addr is None:
        return {}
    return {"nnodes": args.nnodes, "node_rank": args.node_rank, "master_addr": args.master_addr or "127.0.0.1",
            "master_port": args.master_port}
