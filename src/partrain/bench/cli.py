"""``partrain bench NAME``: run one benchmark (see ``partrain.bench``)."""

from __future__ import annotations

import argparse
import importlib

from ..cli import HelpFormatter, register_missing
from ..errors import UsageError
from ..extras import missing_extra, require
from ..files import check_output_file
from . import BENCHMARKS

# the extra a benchmark's partrain side needs beyond the base install
BENCHMARK_EXTRAS = {"serve": "serve", "rl": "rl", "stream": "stream"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark against its baseline and print ratios",
        description="Run a benchmark. Each one measures partrain against the alternative a user "
        "would otherwise pick, in the same run: variants in alternating rounds, medians with "
        "their spread, ratios and goals.",
        formatter_class=HelpFormatter,
    )
    names = p.add_subparsers(dest="bench", metavar="NAME")
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = missing_extra(exc, BENCHMARK_EXTRAS.get(name))
            if missing is None:
                raise
            register_missing(names, name, missing)  # listed; running it names the extra
            continue
        bp = names.add_parser(name, help=(module.__doc__ or name).strip().splitlines()[0],
                              description=module.__doc__,
                              formatter_class=_Formatter)
        bp.add_argument("--quick", action="store_true",
                        help="a smoke run that finishes within about a minute (its figures are noise)")
        # the smallest run that goes through every code path: for the test suite only
        bp.add_argument("--toy", action="store_true", help=argparse.SUPPRESS)
        bp.add_argument("--json", metavar="FILE",
                        help="write every figure, and every goal with its target and verdict, to FILE")
        module.add_arguments(bp)
        bp.set_defaults(func=_run(module), extra=BENCHMARK_EXTRAS.get(name))
    p.set_defaults(func=_no_name)


class _Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Meaningful defaults only; the benchmark's docstring as written."""


def _no_name(args: argparse.Namespace) -> int:
    raise UsageError(f"Expected a benchmark name among {sorted(BENCHMARKS)}. Received: none")


def _run(module):  # noqa: ANN001, ANN202
    def run(args: argparse.Namespace) -> int:
        if args.json is not None:
            check_output_file(args.json, "--json")  # before the run: its figures must not be lost
        if args.extra is not None:
            require(args.extra)  # its servers and learners are other processes: say it here, once
        report = module.run(args)
        report.finish()
        report.write_json(args.json)
        return 0

    return run
