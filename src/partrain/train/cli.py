"""``partrain train``: the standard loop from the command line."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from ..cli import HelpFormatter
from ..data.datasets import load_dataset, num_classes, preprocessing, sample_shape
from ..data.pipeline import LOADERS
from ..env import (
    available_cores,
    external_launcher,
    global_rank_from_environ,
    gpus_for,
    process_started_at,
)
from ..errors import RunFailed, UsageError
from ..models import build_named_model
from ..strategies.base import available, get_strategy, parse_options
from .cli_args import (
    add_model_data_arguments,
    add_optimizer_arguments,
    data_spec,
    mesh_strategy_of,
    model_kwargs,
    optimizer_fn_of,
)
from .config import ON_NAN
from .task import PRECISIONS, Task

DEFAULT_OUT = "runs/train"
#: options --config does not take from the earlier run: where this run writes and how it starts
NOT_REPEATED = ("out", "overwrite", "resume", "config", "quiet")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a model under a parallel strategy (default: a CNN on the bundled digits)",
        description=(
            "Train a model with the standard loop under a strategy. With no arguments: a small CNN on "
            "scikit-learn's bundled handwritten digits, synchronous all-reduce on every core. "
            "Batch size is per worker; --scale-lr applies the linear scaling rule."
        ),
        formatter_class=HelpFormatter,
    )
    s = p.add_argument_group("strategy and processes")
    s.add_argument("--strategy", default=None, metavar="NAME",
                   help=f"how gradients and parameters move: {', '.join(available())} (default: allreduce "
                        "on every core, or single where the caller's timing of a few steps estimates that "
                        "one process finishes first; the start line says which and why)")
    s.add_argument("-o", "--strategy-opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a strategy option, repeatable (e.g. -o staleness=2 -o servers=2)")
    s.add_argument("--mesh", default=None, metavar="AXIS=N,...",
                   help="one device mesh for every axis, e.g. dp=2,tp=2 or fsdp=2,tp=2: dp (data-parallel "
                        "replicas), fsdp (sharded data parallel; with dp: HSDP), tp (tensor parallel, inside "
                        "fsdp), pp (pipeline stages, with dp only). It picks the strategy (leave --strategy "
                        "out; -o passes wrap, reshard_after_forward, plan or the pipeline's options) and "
                        "--workers (the product of the axes). See docs/strategies/fsdp.md, 'Choosing the mesh'")
    s.add_argument("--workers", type=int, default=None,
                   help="worker processes on this machine (default: one per core, or one per GPU with CUDA "
                        "and NCCL; 1 for 'single')")
    s.add_argument("--threads", type=int, default=None, help="intra-op threads per process (default: cores / processes)")
    s.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: gloo on CPU, nccl on CUDA")
    s.add_argument("--device", default="auto", help="cpu, cuda or auto")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds for rendezvous and every collective")
    s.add_argument("--nnodes", type=int, default=1, help="machines in the job (without torchrun)")
    s.add_argument("--node-rank", type=int, default=0, help="this machine's index (without torchrun)")
    s.add_argument("--master-addr", default=None, help="host of node 0 (without torchrun)")
    s.add_argument("--master-port", type=int, default=None, help="port on node 0 (without torchrun)")

    d = p.add_argument_group("model and data")
    add_model_data_arguments(d)
    d.add_argument("--sync-bn", action="store_true", help="convert BatchNorm layers to partrain's SyncBatchNorm")

    f = p.add_argument_group("feeding the device (see docs/data.md)")
    f.add_argument("--loader", choices=LOADERS, default="auto",
                   help="how batches load: auto (in-memory inline, else threads, more when input-bound), inline, "
                        "threads (I/O-bound readers), processes (CPU-bound decoding)")
    f.add_argument("--loader-workers", type=int, default=None, metavar="N",
                   help="loader threads or processes per worker (default 2)")
    f.add_argument("--prefetch", type=int, default=2, metavar="N", help="batches in flight per loader worker")
    f.add_argument("--data-on-device", action="store_true",
                   help="copy the training set to the device once; batches are gathers there")
    f.add_argument("--compile", nargs="?", const=True, default=False, metavar="BACKEND",
                   help="torch.compile the model (inductor; CUDA graphs on CUDA), or with BACKEND "
                        "(e.g. aot_eager); falls back to eager with one line when it fails")

    o = p.add_argument_group("optimization")
    o.add_argument("--epochs", type=int, default=8)
    add_optimizer_arguments(o)
    o.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    o.add_argument("--scale-lr", action="store_true", help="multiply lr by workers x accumulate (linear scaling rule)")
    o.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    o.add_argument("--max-seconds", type=float, default=None, metavar="S",
                   help="stop at the end of the epoch nearest S seconds of training (evaluations not counted); "
                        "--epochs stays the most")
    o.add_argument("--samples-per-epoch", type=int, default=None, metavar="N",
                   help="an epoch of N training samples, each going on through the shuffled set where the last "
                        "stopped (evaluate and checkpoint every N samples of a large set); default: the whole set")
    o.add_argument("--lr-schedule", default="constant", metavar="NAME",
                   help="constant, cosine, linear or step:EPOCHS[:GAMMA], per optimizer step")
    o.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up over these steps")
    o.add_argument("--clip-grad", type=float, default=None, metavar="NORM", help="clip the gradient's L2 norm")
    o.add_argument("--precision", choices=PRECISIONS, default="fp32", help="bf16: autocast the forward pass")
    o.add_argument("--activation-checkpointing", nargs="?", const=True, default=False, metavar="CLASS",
                   help="recompute activations in the backward pass: of the model's repeated blocks, or of the "
                        "modules of class CLASS (comma-separated classes)")
    o.add_argument("--on-nan", choices=ON_NAN, default="stop",
                   help="a non-finite loss or gradient stops the run, skips the step, or is not checked")
    o.add_argument("--early-stop", type=int, default=None, metavar="EPOCHS",
                   help="stop when --monitor has not improved for this many epochs")
    o.add_argument("--monitor", default=None,
                   help="figure for --early-stop and best.pt (default: test_loss), e.g. test_accuracy")

    r = p.add_argument_group("output")
    r.add_argument("--out", default=None,
                   help=f"directory for metrics, curves and checkpoints (default: {DEFAULT_OUT}, or "
                        f"{DEFAULT_OUT}-2, -3, ... when that holds a run)")
    r.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    r.add_argument("--resume", default=None, metavar="PATH|auto",
                   help="continue from a checkpoint ('auto': OUT/checkpoint.pt or OUT/checkpoint.dcp when present)")
    r.add_argument("--config", default=None, metavar="CONFIG_JSON",
                   help="repeat a run: take every option from its config.json (options given here win)")
    r.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                   help="also checkpoint within an epoch every STEPS optimizer steps (exact resume from there)")
    r.add_argument("--checkpoint-seconds", type=float, default=None, metavar="SECONDS",
                   help="also checkpoint within an epoch when SECONDS have passed since the last checkpoint")
    r.add_argument("--checkpoint-async", action="store_true",
                   help="write sharded checkpoints (fsdp, tp) in the background while training goes on")
    r.add_argument("--tensorboard", action="store_true", help="TensorBoard event files in OUT/tensorboard")
    r.add_argument("--quiet", action="store_true", help="no progress bar, no per-epoch lines")
    r.add_argument("--json", default=None, metavar="FILE",
                   help="write the run's summary as JSON: strategy, workers, the last epoch's figures, why it "
                        "stopped, and startup_s (seconds from the command's start to the first optimizer step)")
    p.set_defaults(func=run, _parser=p)


def _checkpointing(value: bool | str) -> bool | str | list[str]:
    if isinstance(value, str) and "," in value:
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def run(args: argparse.Namespace) -> int:
    from ..files import check_output_file
    from .fit import fit
    from .prepare import first_batch

    if args.config:
        _apply_config(args)
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"Expected a positive number of workers. Received: --workers {args.workers}")
    # the start line says what was chosen
    auto = args.strategy is None and args.workers is None and args.mesh is None
    if args.mesh is not None:
        strategy, workers = mesh_strategy_of(args)
    else:
        args.strategy = args.strategy or "allreduce"
        options = parse_options(args.strategy, args.strategy_opt)
        strategy = get_strategy(args.strategy, **options)
        workers = args.workers or min(available_cores(), strategy.max_workers or available_cores())
    gpus = gpus_for(args.device)
    if not args.workers and (args.backend or "nccl") == "nccl" and gpus:
        workers = min(workers, gpus)  # on GPUs: one worker per GPU (NCCL's rule)
    if not 0 < args.test_fraction < 1:
        raise UsageError(f"Expected 0 < --test-fraction < 1. Received: {args.test_fraction}")
    spec = data_spec(args)
    train_ds, test_ds = load_dataset(spec)  # here first: bad data is one line before any process starts
    shape, outputs = sample_shape(train_ds), num_classes(train_ds)
    kwargs = model_kwargs(args, train_ds)
    # fit checks the model against the data, the optimizer settings and the checkpoint, once
    task = Task(args.loss, precision=args.precision)
    task.resolve(first_batch(train_ds, task.collate_fn))  # the task's kind, for the model spec
    optimizer_fn = optimizer_fn_of(args)
    one_launcher = external_launcher() is None and args.nnodes == 1  # not torchrun/srun/PyTorchJob, one node
    out, resume = _run_dir(args, one_launcher)
    if args.json:
        check_output_file(args.json, "--json")  # before the run: its summary must not be lost
    model_fn = functools.partial(build_named_model, args.model, kwargs, args.sync_bn)
    processes = None
    if auto and workers > 1 and one_launcher and not gpus:
        strategy, workers, processes = _processes(args, out, resume, model_fn, optimizer_fn, task, train_ds,
                                                  workers)
    model_spec = {"name": args.model, "kwargs": kwargs, "input_shape": list(shape), "task": task.kind}
    if task.kind == "classification":
        model_spec["num_classes"] = outputs
    pre = preprocessing(spec)
    if pre is not None:
        model_spec["preprocess"] = pre
    if getattr(train_ds, "tokenizer_name", None):  # text data: serving turns text into these ids again
        model_spec["tokenizer"] = train_ds.tokenizer_name
    result = fit(
        model_fn,
        spec,
        optimizer_fn,
        strategy=strategy, loss_fn=args.loss, workers=workers, epochs=args.epochs, batch_size=args.batch_size,
        accumulate=args.accumulate, scale_lr=args.scale_lr, out_dir=out, resume=resume, seed=args.seed,
        quiet=args.quiet, max_steps=args.max_steps, max_seconds=args.max_seconds,
        samples_per_epoch=args.samples_per_epoch, timeout=args.timeout,
        backend=args.backend,
        device=args.device, threads=args.threads, on_nan=args.on_nan, clip_grad=args.clip_grad,
        precision=args.precision, lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
        early_stop=args.early_stop, monitor=args.monitor, tensorboard=args.tensorboard,
        checkpoint_every=args.checkpoint_every, checkpoint_seconds=args.checkpoint_seconds,
        checkpoint_async=args.checkpoint_async,
        overwrite=args.overwrite, return_state=False, model_spec=model_spec,
        loader=args.loader, loader_workers=args.loader_workers, prefetch=args.prefetch,
        data_on_device=args.data_on_device, compile=args.compile,
        activation_checkpointing=_checkpointing(args.activation_checkpointing),
        extra_config={"cli": _cli_settings(args), **({"processes": processes} if processes else {})},
        **_multinode(args),
    )
    if result is not None and args.json:
        _write_summary(args.json, result, args.strategy, workers, out, processes)
    if result is not None and result.history:
        _finite_figures(result.final, args.on_nan)
        tests = [(k[len("test_"):], v) for k, v in result.final.items()
                 if k.startswith("test_") and k != "test_loss" and isinstance(v, float) and v == v]
        shown = ", ".join(f"test {name}: {value:.4f}" for name, value in tests) or \
            f"train loss: {result.train_loss:.4f}"
        epochs = len(result.history)
        print(f"{shown}  ({args.strategy}, {workers} worker{'s' * (workers != 1)}, {epochs} epoch{'s' * (epochs != 1)}; "
              f"metrics, curves and checkpoint in {out})")
        if not args.quiet:
            _show_sample(result.checkpoint, test_ds if test_ds is not None and len(test_ds) else train_ds, args.seed)
    return 0


def _show_sample(checkpoint: str | None, ds: Any, seed: int, tokens: int = 200) -> None:
    """A language model trained on text: a short sample it writes after a prompt from ``ds``."""
    import torch

    from ..checkpoint import load_model

    decode = getattr(ds, "decode", None)
    if decode is None or checkpoint is None or not os.path.exists(checkpoint):
        return
    model, _ = load_model(checkpoint)
    if not hasattr(model, "generate"):
        return
    prompt = ds[0][0][:32].unsqueeze(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ids = model.generate(prompt, tokens, temperature=0.8, top_k=40)[0]
    start, text = decode(prompt[0]), decode(ids[prompt.shape[1]:])
    print(f"sample (temperature 0.8, after the prompt in brackets):\n[{start}]{text}")


def _run_dir(args: argparse.Namespace, one_launcher: bool) -> tuple[str, str | None]:
    """The run's directory (--out, else runs/train numbered when taken) checked, and what it resumes
    (``--resume auto`` with no checkpoint there yet: None)."""
    from ..files import numbered_dir
    from ..sharded_checkpoint import latest_checkpoint
    from .prepare import check_run_dir

    out = args.out
    if out is None:  # a numbered directory only where one process decides it for the whole job
        out = DEFAULT_OUT if args.resume or not one_launcher else numbered_dir(DEFAULT_OUT)
        if out != DEFAULT_OUT and not args.quiet:
            print(f"partrain train: {DEFAULT_OUT} holds a run; writing {out} (--out DIR to choose, "
                  "--overwrite to replace, --resume auto to continue)", flush=True)
    resume = args.resume
    if resume == "auto":
        resume = "auto" if latest_checkpoint(out) is not None else None
    if one_launcher or (global_rank_from_environ() == 0 and args.node_rank == 0):
        check_run_dir(out, resume=bool(args.resume), overwrite=args.overwrite, label="--out")
    return out, resume


def _processes(args: argparse.Namespace, out: str, resume: str | None, model_fn: Callable[[], Any],
               optimizer_fn: Callable[..., Any],
               task: Task, train_ds: Any, workers: int) -> tuple[Any, int, dict[str, Any] | None]:
    """Neither --strategy nor --workers: one process or allreduce on every core, whichever the
    estimate from a few timed steps finishes first (`processes.probe`); a resumed run goes on
    with what its config.json recorded. Returns the strategy, the workers and the estimate."""
    from .processes import probe

    if resume:  # a checkpoint to go on from (--resume auto without one starts afresh)
        recorded = _recorded_strategy(out)
        chosen = recorded if recorded in ("single", "allreduce") else "allreduce"
        args.strategy = chosen
        return get_strategy(chosen), (1 if chosen == "single" else workers), None
    if args.sync_bn or args.strategy_opt:  # options that only mean something to allreduce's workers
        return get_strategy("allreduce"), workers, None
    samples = (args.samples_per_epoch or len(train_ds)) * args.epochs
    choice = probe(model_fn, optimizer_fn, task, train_ds, batch=args.batch_size, workers=workers,
                   cores=available_cores(), run_samples=samples, max_steps=args.max_steps, seed=args.seed)
    if choice is None:
        return get_strategy("allreduce"), workers, None
    if not args.quiet:
        print(choice.line(), flush=True)
    args.strategy = "single" if choice.workers == 1 else "allreduce"
    return get_strategy(args.strategy), choice.workers, choice.as_dict()


def _write_summary(path: str, result: Any, strategy: str, workers: int, out: str,
                   processes: dict[str, Any] | None) -> None:
    """--json: the run in one JSON object (NaN figures as null: JSON has no NaN)."""
    started = process_started_at()
    startup = result.first_step_at - started if started is not None and result.first_step_at else None
    final = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in result.final.items()}
    summary = {"strategy": strategy, "workers": workers, "epochs": len(result.history), "final": final,
               "stopped": result.stopped, "out": out, "checkpoint": result.checkpoint, "startup_s": startup,
               "processes": processes}
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")


def _recorded_strategy(out: str) -> str | None:
    """The strategy a run's config.json records (what a resumed run goes on with), if it can be read."""
    try:
        return _recorded_cli(os.path.join(out, "config.json")).get("strategy")
    except UsageError:
        return None


def _finite_figures(final: dict[str, Any], on_nan: str) -> None:
    """A run whose last figures are NaN or infinite ends with one line and a non-zero status,
    never with a summary and status 0 (the CLI always evaluates: its split holds test samples)."""
    bad = [f"{k.replace('_', ' ')} {v}" for k, v in final.items()
           if (k == "train_loss" or k.startswith("test_")) and isinstance(v, float) and not math.isfinite(v)]
    if bad:
        why = ("--on-nan stop (the default) stops at the first non-finite loss" if on_nan != "stop" else
               "the model's outputs on the test set are not finite")
        raise RunFailed(f"Expected finite figures at the end of the run. Received: {', '.join(bad)} in the last "
                        f"epoch ({why}; the epoch lines and metrics.csv show where they began)")


def _cli_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The command's options as config.json records them (what --config reads back)."""
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("func", "command", "verbose", "argv")}


def _recorded_cli(path: str) -> dict[str, Any]:
    """The options a run's config.json records (its ``cli`` entry); one line when it has none."""
    try:
        with open(path) as f:
            settings = json.load(f)
    except OSError as exc:
        raise UsageError(f"Expected --config to name a run's config.json. Received: {path!r} ({exc.strerror})") from None
    except ValueError as exc:
        raise UsageError(f"Expected --config to be JSON (a run's config.json). Received: {path!r} ({exc})") from None
    cli = settings.get("cli") if isinstance(settings, dict) else None
    if not isinstance(cli, dict):
        raise UsageError(f"Expected a config.json written by 'partrain train' (with a 'cli' entry). Received: {path!r}")
    return cli


def _apply_config(args: argparse.Namespace) -> None:
    """Options of an earlier run's config.json, except those given on this command line."""
    path = args.config
    cli = _recorded_cli(path)
    parser: argparse.ArgumentParser = args._parser
    explicit = _explicit_dests(parser, getattr(args, "argv", None))
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(cli) - known)
    if unknown:
        raise UsageError(f"Expected options of this partrain version in {path!r}. Received unknown: {', '.join(unknown)}")
    for key, value in cli.items():
        if key not in explicit and key not in NOT_REPEATED:
            setattr(args, key, value)


def _explicit_dests(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The options given on the command line (by their dest), from the raw arguments."""
    if argv is None:
        argv = sys.argv[1:]
    strings = parser._option_string_actions
    explicit = set()
    for token in argv:
        if not token.startswith("-") or token == "-":
            continue
        name = token.split("=", 1)[0]
        action = strings.get(name)
        if action is None and name.startswith("--"):
            matches = {a for s, a in strings.items() if s.startswith(name)}
            action = matches.pop() if len(matches) == 1 else None
        if action is not None:
            explicit.add(action.dest)
    return explicit


def _multinode(args: argparse.Namespace) -> dict[str, Any]:
    if args.nnodes == 1 and args.master_addr is None:
        return {}
    return {"nnodes": args.nnodes, "node_rank": args.node_rank, "master_addr": args.master_addr or "127.0.0.1",
            "master_port": args.master_port}
