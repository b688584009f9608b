"""The ``partrain`` command: ``train``, ``serve``, ``loadtest``, ``population``, ``bench``, ``export``, ...

Each subcommand lives beside the code it drives and exposes
``register(subparsers)``, which adds its parser (with ``formatter_class=HelpFormatter``)
and sets ``func(args) -> int``. Bad input (`UsageError`) becomes one line on stderr and
exit status 2.

SIGINT and SIGTERM stop a command the same way: the signal becomes an `Interrupted`
exception in the main thread, every child process the command started is asked to
stop at once, the unwinding removes temporary directories, the children are reaped
(killed if they linger), and the command prints one line and exits with 128 + the
signal (130 for SIGINT, 143 for SIGTERM):
``partrain train: stopped by SIGTERM; 2 worker processes stopped``.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import multiprocessing
import os
import re
import sys
import traceback
from collections import Counter
from typing import Any, NoReturn

from ._process import stop_processes
from ._signals import signals_raise
from .errors import (
    Interrupted,
    RunFailed,
    UsageError,
    WorkerError,
    exception_line,
    signal_name,
    user_frame,
)
from .extras import MissingExtra, missing_extra, needs

# subcommand -> module exposing register(subparsers)
SUBCOMMANDS = {
    "train": "partrain.train.cli",
    "population": "partrain.population.cli",
    "serve": "partrain.serve.cli",
    "stream": "partrain.stream.cli",
    "rl": "partrain.rl.cli",
    "loadtest": "partrain.serve.loadtest_cli",
    "bench": "partrain.bench.cli",
    "compare": "partrain.compare.cli",
    "export": "partrain.checkpoint_cli",
}


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows an option's default only when it tells the reader something.

    ``argparse.ArgumentDefaultsHelpFormatter`` appends ``(default: None)`` to options
    that have no default, ``(default: False)`` to every flag and ``(default: [])`` to
    repeatable options. This one appends ``(default: X)`` only when X is a value (not
    None, not False for a flag, not an empty list or string) and the help text does not
    already speak of its default; an option without help text gets ``default: X`` alone.
    Use it for every parser: ``formatter_class=HelpFormatter``.
    """

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and meaningful_default(action):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not meaningful_default(action) or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


def meaningful_default(action: argparse.Action) -> bool:
    """True when ``action``'s default is worth printing in its help."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or action.help is argparse.SUPPRESS:
        return False
    if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
        return False  # a required positional has no default to speak of
    if action.nargs == 0:  # a flag (store_true, store_const, count...): its default is its absence
        return False
    if isinstance(default, (list, tuple, dict, set, str)) and len(default) == 0:
        return False
    return True


def version() -> str:
    """partrain's version: the installed distribution's, else the package's ``__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("partrain")
    except PackageNotFoundError:
        from . import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (argparse prints the whole usage first: 30
    lines for ``partrain train``, the error last) with where the options are listed."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ('{self.prog} --help' lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="partrain",
        description=(
            "Train and serve PyTorch models in parallel: all-reduce, parameter server, "
            "Hogwild, local SGD; dynamic-batching inference; populations of models."
        ),
        epilog="Run 'partrain COMMAND --help' for the options of one command.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"partrain {version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command, module_name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = missing_extra(exc)
            if missing is None:
                raise
            # a command module that imports its extra too early: the command still lists,
            # and running it says which extra to install (tests/test_base_install.py guards
            # that no module does)
            register_missing(sub, command, missing)
            continue
        module.register(sub)
    return parser


#: a value that starts with a minus sign and is no plain number: a shape with a dynamic dim (-1,3)
_NEGATIVE_LIST = re.compile(r"^-\d+(?:\.\d+)?(?:[,x]-?\d+(?:\.\d+)?)+$")


def negative_values(argv: list[str]) -> list[str]:
    """``--input-shape -1,3`` as ``--input-shape=-1,3``: argparse reads a token that starts with
    '-' as an option unless it is one plain negative number, so a list of numbers that starts
    with a negative one is joined to the option before it (no option is named like a number)."""
    out: list[str] = []
    for token in argv:
        if out and _NEGATIVE_LIST.match(token) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def register_missing(sub: Any, command: str, missing: MissingExtra) -> None:
    """A parser for ``command`` whose run says which extra it needs (its options need that extra too)."""

    def refuse(args: argparse.Namespace) -> int:
        raise missing

    p = sub.add_parser(command, help=f"(needs the '{missing.extra}' extra)",
                       description=needs(missing.extra), formatter_class=HelpFormatter)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=refuse)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(negative_values(given))
    args.argv = given  # what was given (e.g. to tell it from --config)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if argv is None or not argv else 2
    children = _Children()
    with signals_raise(take_over=True, on_signal=children.stop_now):
        try:
            try:
                return int(args.func(args) or 0)
            except ModuleNotFoundError as exc:
                missing = missing_extra(exc, getattr(args, "extra", None))
                if missing is None:
                    raise
                raise missing from exc
        except UsageError as exc:
            if args.verbose:
                raise
            print(f"partrain {args.command}: error: {_one_line(exc)}", file=sys.stderr)
            return 2
        except RunFailed as exc:
            print(f"partrain {args.command}: error: {_one_line(exc)}", file=sys.stderr)
            return 1
        except WorkerError as exc:
            if args.verbose and exc.traceback:
                print(exc.traceback, file=sys.stderr)
            print(f"partrain {args.command}: error: {_one_line(exc)}", file=sys.stderr)
            return 1
        except Interrupted as stop:
            children.reap()
            print(f"partrain {args.command}: stopped by {signal_name(stop.signum)}{children.summary()}",
                  file=sys.stderr)
            return stop.exit_status
        except KeyboardInterrupt:  # a SIGINT handler of someone else's raised it
            children.reap()
            print(f"partrain {args.command}: interrupted{children.summary()}", file=sys.stderr)
            return 130
        except Exception as exc:
            # an error that came through the user's code (their model, dataset or loss function):
            # one line with their file and line; anything else is partrain's to fix (a traceback)
            if args.verbose or user_frame(exc.__traceback__) is None:
                raise
            print(f"partrain {args.command}: error: {exception_line(exc, '-v for the traceback')}", file=sys.stderr)
            return 1


def _quiet_resource_sharer(hook: Any) -> Any:
    """``hook``, minus the tracebacks of multiprocessing's resource-sharer thread.

    That thread hands file descriptors (torch's shared tensors) to child processes and
    reports any failure through ``sys.excepthook``; a child stopped by the signal in the
    middle of a hand-over is such a failure, expected, and not the user's to read.
    """
    def quiet(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        frames = traceback.extract_tb(tb)
        if any(f.filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")) for f in frames):
            return
        hook(kind, value, tb)
    return quiet


class _Children:
    """The child processes a command started, as the signal found them.

    At the signal every live child is sent SIGTERM at once (``stop_now``): a child the
    main thread is not waiting on (a benchmark's helper) stops too, and the ones it is
    waiting on stop sooner. After the unwinding, ``reap`` waits for them (bounded) and
    kills any that linger.
    """

    def __init__(self) -> None:
        self.signalled: list[Any] = []

    def stop_now(self, signum: int) -> None:
        self.signalled = multiprocessing.active_children()
        sys.excepthook = _quiet_resource_sharer(sys.excepthook)
        for p in self.signalled:
            try:
                p.terminate()
            except OSError:  # already gone
                pass

    def reap(self) -> None:
        stop_processes(self.signalled + multiprocessing.active_children())

    def summary(self) -> str:
        """``; 2 worker processes stopped`` (nothing when there were none)."""
        kinds = Counter(_kind(p.name) for p in self.signalled)
        if not kinds:
            return ""
        parts = [f"{n} {kind} process{'es' if n > 1 else ''}" for kind, n in sorted(kinds.items())]
        return "; " + " and ".join(parts) + " stopped"


def _kind(process_name: str) -> str:
    """What a child process is, from the name partrain gives it (pool.py, serve/replicas.py,
    serve/loadtest/processes.py)."""
    if process_name.startswith(("partrain-rank", "partrain-pool")):
        return "worker"
    if process_name.startswith("partrain-replica"):
        return "replica"
    if process_name.startswith("partrain-loadtest"):
        return "load-generator"
    return "child"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
