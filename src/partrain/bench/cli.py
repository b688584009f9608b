"""``partrain bench NAME``: run one benchmark (see ``partrain.bench``)."""

from __future__ import annotations

import argparse
import importlib

from ..errors import UsageError
from . import BENCHMARKS
from .common import write_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark against its baseline and print ratios",
        description="Run a benchmark. Each one measures partrain against the alternative a user "
        "would otherwise pick, in the same run, and prints the ratios.",
    )
    names = p.add_subparsers(dest="bench", metavar="NAME")
    for name, module_name in BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("partrain"):
                continue
            raise
        bp = names.add_parser(name, help=(module.__doc__ or name).strip().splitlines()[0],
                              description=module.__doc__)
        bp.add_argument("--quick", action="store_true", help="a smaller run that finishes within a minute")
        bp.add_argument("--json", metavar="FILE", help="write every printed figure to FILE as JSON")
        module.add_arguments(bp)
        bp.set_defaults(func=_run(module))
    p.set_defaults(func=_no_name)


def _no_name(args: argparse.Namespace) -> int:
    raise UsageError(f"Expected a benchmark name among {sorted(BENCHMARKS)}. Received: none")


def _run(module):  # noqa: ANN001, ANN202
    def run(args: argparse.Namespace) -> int:
        figures = module.run(args)
        write_json(args.json, figures)
        return 0

    return run
