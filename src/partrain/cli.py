"""The ``partrain`` command: ``train``, ``serve``, ``loadtest``, ``population``, ``bench``.

Each subcommand lives beside the code it drives and exposes
``register(subparsers)``, which adds its parser and sets ``func(args) -> int``.
Bad input (`UsageError`) becomes one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import UsageError, WorkerError

# subcommand -> module exposing register(subparsers)
SUBCOMMANDS = {
    "train": "partrain.train.cli",
    "population": "partrain.population.cli",
    "serve": "partrain.serve.cli",
    "loadtest": "partrain.serve.loadtest_cli",
    "bench": "partrain.bench.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partrain",
        description=(
            "Train and serve PyTorch models in parallel: all-reduce, parameter server, "
            "Hogwild, local SGD; dynamic-batching inference; populations of models."
        ),
        epilog="Run 'partrain COMMAND --help' for the options of one command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("partrain"):
                continue  # subcommand not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what was given (e.g. to tell it from --config)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if argv is None or not argv else 2
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        if args.verbose:
            raise
        print(f"partrain {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        if args.verbose and exc.traceback:
            print(exc.traceback, file=sys.stderr)
        print(f"partrain {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"partrain {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
