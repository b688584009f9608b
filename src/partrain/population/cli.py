"""``partrain population``: train N members on a dataset (default: the bundled digits), with PBT.

Writes to ``--out``: ``leaderboard.csv`` (also printed), ``history.csv`` (every
member at every evaluation), ``lineage.jsonl`` (who copied whom, when, with which
hyperparameters), ``curves.png``, ``best.pt`` (the best member as a partrain
checkpoint that ``partrain train --resume`` and ``partrain serve`` load) and
``population.pt`` (the whole population, for ``--resume``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from ..cli import HelpFormatter
from ..errors import UsageError
from .prepare import DEFAULT_STEPS

DEFAULT_SPACES = {
    "sgd": ["lr=loguniform:1e-3:3e-1", "momentum=choice:0.0,0.5,0.9"],
    "adam": ["lr=loguniform:1e-4:1e-2"],
    "adamw": ["lr=loguniform:1e-4:1e-2", "weight_decay=loguniform:1e-4:1e-1"],
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "population",
        help="train many models at once in one process, with population-based training",
        description="Train --members copies of a model on --dataset (default: scikit-learn's digits), each "
        "with its own seed, data order and hyperparameters drawn from --space, stepped together by a "
        "vectorized (vmap) or loop engine (auto: the faster one, measured). With --pbt-interval K, every K "
        "steps the worst quantile copies the best members (weights and optimizer state) and perturbs or "
        "resamples their hyperparameters. Classification only: integer class labels, cross-entropy.",
        epilog="Example: partrain population --members 16 --space lr=loguniform:1e-3:1e-1 "
        "--space momentum=choice:0.0,0.9 --steps 400 --pbt-interval 50 --out runs/pbt",
        formatter_class=HelpFormatter)
    p.add_argument("--members", type=int, default=8, help="population size (default 8)")
    p.add_argument("--space", action="append", default=[], metavar="NAME=KIND:ARGS",
                   help="a hyperparameter's search space, repeatable: loguniform:LOW:HIGH, "
                   "uniform:LOW:HIGH, randint:LOW:HIGH, choice:V1,V2,... or a number. Names: lr, "
                   "momentum, weight_decay (sgd); lr, beta1, beta2, eps, weight_decay (adam, adamw); "
                   "batch_size, dropout. Default: lr and momentum (sgd) or lr (adam)")
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd")
    p.add_argument("--nesterov", action="store_true", help="Nesterov momentum (sgd)")
    p.add_argument("--model", default="cnn", help="built-in model or module:function (default cnn)")
    p.add_argument("--dataset", default="digits",
                   help="digits, synthetic, a .npz file with x and integer y, or module:function (default digits)")
    p.add_argument("--synthetic-samples", type=int, default=4096, help="samples of --dataset synthetic (default 4096)")
    p.add_argument("--synthetic-shape", default="1,8,8", help="sample shape of --dataset synthetic (default 1,8,8)")
    p.add_argument("--synthetic-classes", type=int, default=10, help="classes of --dataset synthetic (default 10)")
    p.add_argument("--test-fraction", type=float, default=0.2,
                   help="share of the dataset held out as the test set (default 0.2)")
    p.add_argument("--engine", choices=["auto", "vmap", "loop"], default="auto",
                   help="how members are stepped; auto times both on the first steps (default)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help=f"steps per member in total (default {DEFAULT_STEPS})")
    length.add_argument("--epochs", type=float, help="epochs per member (at --batch-size)")
    p.add_argument("--batch-size", type=int, default=32, help="per-member batch size (default 32)")
    p.add_argument("--pbt-interval", type=int, default=50, metavar="K",
                   help="steps between PBT rounds; 0 turns PBT off (default 50)")
    p.add_argument("--eval-interval", type=int, help="steps between evaluations (default: K, or steps/10)")
    p.add_argument("--quantile-fraction", type=float, default=0.25, help="PBT quantile (default 0.25)")
    p.add_argument("--perturbation-factors", default="1.2,0.8", help="PBT factors (default 1.2,0.8)")
    p.add_argument("--resample-probability", type=float, default=0.25, help="PBT resampling (default 0.25)")
    p.add_argument("--metric", choices=["accuracy", "loss"], default="accuracy",
                   help="validation metric PBT ranks members by (default accuracy)")
    p.add_argument("--workers", type=int, default=1, help="processes to spread members over (default 1)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds for rendezvous and every collective with --workers > 1 (default 300)")
    p.add_argument("--out", default=None,
                   help=f"output directory (default {DEFAULT_OUT}, or {DEFAULT_OUT}-2, -3, ... when that holds a run)")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/population.pt up to --steps")
    p.add_argument("--quiet", action="store_true", help="print only the leaderboard")
    p.set_defaults(func=run)


DEFAULT_OUT = "runs/population"


def _out(args: argparse.Namespace) -> str:
    """``--out``, or the default directory (numbered when it holds a run, said in one line)."""
    if args.out is not None:
        return args.out
    from ..files import numbered_dir
    from .prepare import RUN_FILES

    out = DEFAULT_OUT if args.resume else numbered_dir(DEFAULT_OUT, RUN_FILES)
    if out != DEFAULT_OUT and not args.quiet:
        print(f"partrain population: {DEFAULT_OUT} holds a run; writing {out} (--out DIR to choose, "
              "--overwrite to replace, --resume to continue)", flush=True)
    return out


def config_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Validate the options on their own into a JSON-able config (one line UsageError on bad input).

    What needs the data, the model or a checkpoint is checked next, still before any
    process starts (`prepare.prepare`).
    """
    from .space import describe, parse_space_entry

    def positive(value: float | None, option: str, what: str) -> None:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"Expected a positive number of {what}. Received: {option} {value}")

    positive(args.members, "--members", "members")
    positive(args.batch_size, "--batch-size", "samples per batch")
    positive(args.steps, "--steps", "steps")
    positive(args.epochs, "--epochs", "epochs")
    positive(args.eval_interval, "--eval-interval", "steps between evaluations")
    positive(args.timeout, "--timeout", "seconds")
    positive(args.synthetic_samples, "--synthetic-samples", "samples")
    positive(args.synthetic_classes, "--synthetic-classes", "classes")
    if args.pbt_interval < 0:
        raise UsageError(f"Expected --pbt-interval >= 0 (0: off). Received: {args.pbt_interval}")
    if args.workers < 1 or args.workers > args.members:
        raise UsageError(f"Expected 1 <= --workers <= --members ({args.members}). Received: --workers {args.workers}")
    if not 0 < args.test_fraction < 1:
        raise UsageError(f"Expected 0 < --test-fraction < 1. Received: {args.test_fraction}")
    if not 0 <= args.quantile_fraction <= 0.5:
        raise UsageError(f"Expected 0 <= --quantile-fraction <= 0.5. Received: {args.quantile_fraction}")
    if not 0 <= args.resample_probability <= 1:
        raise UsageError(f"Expected 0 <= --resample-probability <= 1. Received: {args.resample_probability}")
    try:
        factors = [float(f) for f in args.perturbation_factors.split(",")]
        if not all(math.isfinite(f) and f > 0 for f in factors):
            raise ValueError
    except ValueError:
        raise UsageError(f"Expected --perturbation-factors as positive numbers separated by commas. "
                         f"Received: {args.perturbation_factors!r}") from None
    try:
        shape = [int(v) for v in args.synthetic_shape.split(",")]
        if not all(v > 0 for v in shape):
            raise ValueError
    except ValueError:
        raise UsageError(f"Expected --synthetic-shape as positive integers separated by commas. "
                         f"Received: {args.synthetic_shape!r}") from None
    if args.nesterov and args.optimizer != "sgd":
        raise UsageError(f"Expected --nesterov only with --optimizer sgd. Received: --optimizer {args.optimizer}")
    entries = args.space or DEFAULT_SPACES[args.optimizer]
    space = dict(parse_space_entry(e) for e in entries)
    return {
        "members": args.members, "space": {k: describe(v) for k, v in space.items()},
        "space_args": list(entries), "optimizer": args.optimizer, "nesterov": args.nesterov,
        "model": args.model, "dataset": args.dataset, "synthetic_samples": args.synthetic_samples,
        "synthetic_shape": shape, "synthetic_classes": args.synthetic_classes,
        "test_fraction": args.test_fraction, "engine": args.engine, "steps": args.steps,
        "epochs": args.epochs, "batch_size": args.batch_size, "pbt_interval": args.pbt_interval,
        "eval_interval": args.eval_interval, "quantile_fraction": args.quantile_fraction,
        "perturbation_factors": factors, "resample_probability": args.resample_probability,
        "metric": args.metric, "workers": args.workers, "timeout": args.timeout, "out": _out(args),
        "seed": args.seed, "resume": args.resume, "quiet": args.quiet, "overwrite": args.overwrite,
    }


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from .run import run_population

    summary = run_population(cfg)
    if not cfg["quiet"]:
        print(f"engine: {summary['engine_line']}", file=sys.stderr)
    print(summary["leaderboard_text"])
    print(f"best member {summary['best']}: test accuracy {summary['best_test_accuracy']:.4f} -> "
          f"{os.path.join(cfg['out'], 'best.pt')} (step {summary['steps']}, epoch {summary['best_epoch']})")
    return 0
