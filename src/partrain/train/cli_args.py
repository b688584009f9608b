"""The model, data and optimizer options `partrain train` and `partrain compare` share: their
arguments, and what they resolve to (the data spec, a built-in model's options, the optimizer)."""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from typing import Any

from ..data.datasets import DataSpec, num_classes, sample_shape
from ..errors import UsageError
from ..models import MODELS, model_kwargs_for
from ..optim import OPTIMIZERS, make_optimizer
from .task import LOSSES


def add_model_data_arguments(d: argparse._ArgumentGroup) -> None:
    """The model and data options (``partrain train`` and ``partrain compare`` share them)."""
    d.add_argument("--model", default="cnn", help=f"one of {', '.join(MODELS)} or module:function")
    d.add_argument("--model-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of a built-in model, repeatable (e.g. --model-opt n_layer=6 for gpt)")
    d.add_argument("--dataset", default="digits",
                   help="digits, synthetic, a .npz file with x/y, a .csv file with a header, text (the bundled "
                        "corpus), text:PATH (a UTF-8 file or directory), or module:function")
    d.add_argument("--block-size", type=int, default=128, metavar="TOKENS",
                   help="tokens per sample of a text --dataset")
    d.add_argument("--tokenizer", default=None, metavar="NAME",
                   help="a cached Hugging Face tokenizer for a text --dataset (default: UTF-8 bytes)")
    d.add_argument("--target", default=None, metavar="COLUMN",
                   help="the target column of a .csv --dataset (default: the last); integers or words are classes, "
                        "other numbers values to predict")
    d.add_argument("--synthetic-samples", type=int, default=4096, help="samples of --dataset synthetic")
    d.add_argument("--synthetic-shape", default="1,8,8", help="sample shape of --dataset synthetic")
    d.add_argument("--synthetic-classes", type=int, default=10, help="classes of --dataset synthetic")
    d.add_argument("--test-fraction", type=float, default=0.2, help="held-out share for evaluation")


def data_spec(args: argparse.Namespace) -> DataSpec:
    """The data the model and data options name (``partrain train`` and ``partrain compare``)."""
    if args.block_size < 2:
        raise UsageError(f"Expected --block-size of at least 2 tokens. Received: {args.block_size}")
    return DataSpec(name=args.dataset, samples=args.synthetic_samples, shape=parse_shape(args.synthetic_shape),
                    classes=args.synthetic_classes, test_fraction=args.test_fraction, seed=args.seed,
                    target=args.target, block_size=args.block_size, tokenizer=args.tokenizer)


def model_kwargs(args: argparse.Namespace, train_ds: Any) -> dict[str, Any]:
    """A built-in model's options for the data (its shape, classes or vocabulary) and --model-opt."""
    if args.model not in MODELS:
        if args.model_opt:
            raise UsageError(f"Expected --model-opt with a built-in model ({', '.join(MODELS)}). Received: "
                             f"--model {args.model!r}, whose options are its factory's own")
        return {}
    kwargs = model_kwargs_for(args.model, sample_shape(train_ds), num_classes(train_ds))
    if args.model == "gpt":  # an epoch of the bundled corpus in about half a minute on two cores
        kwargs.update(n_layer=4, n_head=4, n_embd=128)
    for pair in args.model_opt:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"Expected --model-opt as KEY=VALUE. Received: {pair!r}")
        try:
            kwargs[key.strip()] = json.loads(raw)
        except ValueError:
            kwargs[key.strip()] = raw
    return kwargs


def optimizer_fn_of(args: argparse.Namespace) -> Callable[..., Any]:
    """The optimizer the options name; by default AdamW for a transformer (``gpt``), on which SGD
    crawls, and SGD with momentum for the rest."""
    name = args.optimizer or ("adamw" if args.model == "gpt" else "sgd")
    lr = args.lr if args.lr is not None else (0.05 if name == "sgd" else 1e-3)
    return functools.partial(make_optimizer, name, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)


def add_optimizer_arguments(o: argparse._ArgumentGroup) -> None:
    """The batch, optimizer, seed and loss options (``partrain train`` and ``partrain compare``)."""
    o.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    o.add_argument("--lr", type=float, default=None, help="default: 0.05 for sgd, 0.001 for adam/adamw")
    o.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="default: adamw for gpt, else sgd")
    o.add_argument("--momentum", type=float, default=0.9, help="for sgd")
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--loss", default="auto", choices=LOSSES,
                   help="per-sample loss; auto: cross_entropy for integer labels, mse for float targets")


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(v < 1 for v in shape):
        raise UsageError(f"Expected --synthetic-shape as positive integers separated by commas. Received: {text!r}")
    return shape


def mesh_strategy_of(args: argparse.Namespace) -> tuple[Any, int]:
    """--mesh: the strategy it picks (``args.strategy`` set to its name, for the lines and the
    summary) and the workers, the product of its axes unless --workers says (then they must agree)."""
    from ..mesh import MeshSpec
    from ..strategies.base import parse_options
    from ..strategies.mesh import strategy_for, strategy_name

    spec = MeshSpec.of(args.mesh)
    picked = strategy_name(spec)
    if args.strategy not in (None, picked):  # the picked one: a run repeated by --config records it
        raise UsageError(f"Expected either --strategy or --mesh (the mesh picks the strategy). Received: "
                         f"--strategy {args.strategy} --mesh {args.mesh}")
    args.strategy = picked
    strategy = strategy_for(spec, **parse_options(args.strategy, args.strategy_opt))
    workers = args.workers or spec.size // max(args.nnodes, 1)
    spec.check_workers(workers * args.nnodes)
    return strategy, workers
