"""``partrain export RUN_DIR [--out FILE]``: a sharded checkpoint written as one file.

A run of ``fsdp`` or ``tp`` checkpoints as ``RUN_DIR/checkpoint.dcp`` (every process its own
shards, `partrain.sharded_checkpoint`) and exports ``RUN_DIR/checkpoint.pt`` at its end; this
command does the export for a run that did not reach its end (stopped, killed) or for another
version (``best.dcp``). It reads the shards in this one process, with no process group and no
workers: the file holds the whole model and optimizer state in plain tensors, the format
``partrain serve``, `partrain.checkpoint.load_model` and every strategy (``single`` too) read.
"""

from __future__ import annotations

import argparse
import os

from .errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    from .cli import HelpFormatter

    p = sub.add_parser(
        "export",
        help="write a sharded (fsdp, tp) checkpoint as one file that serve and every strategy load",
        description=("Read the newest version of a sharded checkpoint (RUN_DIR/checkpoint.dcp, or the "
                     "directory given) in this process and write it as one checkpoint file: the whole model "
                     "and optimizer state in plain tensors, written atomically."),
        formatter_class=HelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run directory holding checkpoint.dcp, or a sharded checkpoint directory itself")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where to write (default: RUN_DIR/checkpoint.pt; for a NAME.dcp directory, NAME.pt "
                        "beside it)")
    p.set_defaults(func=run)


def sources(path: str) -> tuple[str, str]:
    """The sharded checkpoint ``path`` names (a run directory's ``checkpoint.dcp``, or ``path``)
    and where its one-file form goes by default. One line when there is none."""
    from .sharded_checkpoint import SHARDED_NAME, latest_version

    in_run = os.path.join(path, SHARDED_NAME)
    if latest_version(in_run) is not None:
        return in_run, os.path.join(path, "checkpoint.pt")
    if latest_version(path) is not None:
        root = os.path.normpath(path)
        if os.path.isfile(os.path.join(root, ".metadata")):  # one version: name the file after its directory
            root = os.path.dirname(root)
        return path, os.path.splitext(root)[0] + ".pt"
    why = "no such directory" if not os.path.isdir(path) else f"neither it nor {SHARDED_NAME} in it holds a complete one"
    raise UsageError(f"Expected a run directory with a sharded checkpoint ({SHARDED_NAME}) or a sharded checkpoint "
                     f"directory. Received: {path!r} ({why})")


def run(args: argparse.Namespace) -> int:
    from .files import check_output_file
    from .sharded_checkpoint import export, latest_version, progress

    source, default = sources(args.run_dir)
    out = args.out or default
    check_output_file(out, "--out")
    step, epoch = progress(source)
    export(source, out)
    version = latest_version(source)
    print(f"partrain export: wrote {out} (step {step}, epoch {epoch}) from {version}", flush=True)
    return 0
