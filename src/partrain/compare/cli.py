"""``partrain compare``: the strategies measured on your model, a recommendation, a scaling prediction.

The model, data and optimizer options are ``partrain train``'s (same names, same defaults).
"""

from __future__ import annotations

import argparse
import functools

from ..cli import HelpFormatter
from ..errors import UsageError

DEFAULT_OUT = "runs/compare"
#: the files a comparison writes: a directory holding one of them holds a comparison
OUT_FILES = ("compare.json", "compare.csv", "compare.png")


def register(sub: argparse._SubParsersAction) -> None:
    from ..train.cli_args import add_model_data_arguments, add_optimizer_arguments
    from .run import CANDIDATES, DEFAULT_LINKS, OPT_IN

    p = sub.add_parser(
        "compare",
        help="measure every strategy on your model for a short window and recommend one",
        description=(
            "Run each applicable strategy (single, allreduce, ps sync/async, hogwild, localsgd, DiLoCo, "
            "pipeline; fsdp and tp when named, or when the model only fits sharded) for a short measured window on your model and data, within --budget; print a "
            "ranked table (samples/s, step breakdown, bytes per sample, loss at equal samples, memory), "
            "a recommendation with reasons, and the predicted scaling to 8, 64 and 512 workers."
        ),
        formatter_class=HelpFormatter,
    )
    c = p.add_argument_group("comparison")
    c.add_argument("--budget", default="60s", help="total time for the whole comparison (e.g. 60s, 2m)")
    c.add_argument("--strategies", default=None, metavar="LIST",
                   help=f"comma-separated among: {', '.join(x.label for x in CANDIDATES)} (default: all that apply, "
                        f"but {', '.join(sorted(OPT_IN))}: only when named)")
    c.add_argument("--workers", type=int, default=None, help="processes of the parallel strategies "
                   "(default: one per core, at least 2)")
    c.add_argument("--straggler", default=None, metavar="worker=I,slowdown=F",
                   help="what if worker I ran F times slower (an injected delay)")
    c.add_argument("--bandwidth", default=None, metavar="RATE",
                   help="what if the workers talked over a link of RATE (e.g. 1Gbit): simulated from measured bytes")
    c.add_argument("--links", default=DEFAULT_LINKS, help="link speeds of the scaling prediction")
    c.add_argument("--memory-per-process", default=None, metavar="SIZE",
                   help="each process's memory (e.g. 4GB): strategies whose processes would hold more of the "
                        "model's state are skipped (default: the host's available memory / workers)")
    c.add_argument("--device", default="auto", help="where the workers train: auto (default: the GPUs when "
                   "there is one per worker, else the CPU), cpu, cuda")
    c.add_argument("--threads", type=int, default=None, help="intra-op threads per process (default: cores / workers)")
    c.add_argument("--timeout", type=float, default=120.0, help="seconds for rendezvous and every collective")
    c.add_argument("--out", default=None,
                   help=f"directory for compare.json, compare.csv, compare.png (default {DEFAULT_OUT}, numbered "
                        f"{DEFAULT_OUT}-2, -3, ... when it holds a comparison, like partrain train's runs)")

    add_model_data_arguments(p.add_argument_group("model and data (as partrain train)"))
    add_optimizer_arguments(p.add_argument_group("optimization (as partrain train)"))
    p.add_argument("--json", action="store_true", help="print compare.json's content instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from ..data.datasets import load_dataset
    from ..models import build_named_model
    from ..train.cli_args import data_spec, model_kwargs, optimizer_fn_of
    from .options import parse_bandwidth, parse_budget, parse_links, parse_straggler
    from .report import format_result, to_json
    from .run import CANDIDATES, OVER_BUDGET, compare

    if args.workers is not None and args.workers < 1:
        raise UsageError(f"Expected a positive number of workers. Received: --workers {args.workers}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"Expected a positive number of threads. Received: --threads {args.threads}")
    if not 0 < args.test_fraction < 1:
        raise UsageError(f"Expected 0 < --test-fraction < 1. Received: {args.test_fraction}")
    strategies = None
    if args.strategies is not None:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        known = [c.label for c in CANDIDATES]
        if not strategies or any(s not in known for s in strategies):
            raise UsageError(f"Expected strategies among {known}. Received: {strategies}")
    # every option checked before the data loads and any process starts
    parse_budget(args.budget)
    straggler = parse_straggler(args.straggler)
    if straggler is not None and straggler.worker >= (args.workers or 2):
        raise UsageError(f"Expected the straggler to be a worker index below workers={args.workers or 2}. "
                         f"Received: worker={straggler.worker}")
    parse_bandwidth(args.bandwidth)
    parse_links(args.links)
    from .run import compare_device, default_workers

    compare_device(args.device, default_workers(args.workers))  # before the data loads
    spec = data_spec(args)
    train_ds, _ = load_dataset(spec)
    kwargs = model_kwargs(args, train_ds)
    optimizer_fn = optimizer_fn_of(args)
    out = args.out
    if out is None:
        from ..files import numbered_dir

        out = numbered_dir(DEFAULT_OUT, OUT_FILES)
        if out != DEFAULT_OUT and not args.json:
            _progress(f"{DEFAULT_OUT} holds a comparison; writing {out} (--out DIR to choose)")
    result = compare(functools.partial(build_named_model, args.model, kwargs), spec, optimizer_fn,
                     strategies=strategies, workers=args.workers, budget=args.budget, batch_size=args.batch_size,
                     loss_fn=args.loss, straggler=args.straggler, bandwidth=args.bandwidth, links=args.links,
                     out_dir=out, threads=args.threads, timeout=args.timeout, seed=args.seed,
                     device=args.device, progress=None if args.json else _progress, memory=args.memory_per_process)
    if args.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(format_result(result))
        if result.files:
            print(f"\nfiles: {', '.join(result.files.values())}")
    if result.recommendation is None:
        if any(m.reason.startswith(OVER_BUDGET) for m in result.measurements):
            raise UsageError(f"Expected a budget with room for the windows after start-up. Received: --budget "
                             f"{result.budget_s:g}s, of which starting the processes took {result.startup_s:.1f} s: "
                             f"no strategy fitted in the rest (the default is 60s)")
        raise UsageError("Expected at least one strategy to run. Received: every one skipped or failed "
                         "(see the table)")
    return 0


def _progress(text: str) -> None:
    import sys

    print(f"  {text}", file=sys.stderr, flush=True)
