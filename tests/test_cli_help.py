"""``partrain --version`` and help text that shows a default only where it says something.

`partrain.cli.HelpFormatter` is the formatter every subcommand's parser uses; the
test builds a small parser with each kind of option rather than reading partrain's
own help, which changes with its options.
"""

import argparse
from importlib.metadata import version

import pytest

import partrain
from partrain.cli import HelpFormatter, main


def small_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tool", formatter_class=HelpFormatter)
    p.add_argument("source", help="what to read")
    p.add_argument("--epochs", type=int, default=8, help="passes over the data")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", default="runs/train", help="where results go")
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    p.add_argument("--resume", default=None, help="a checkpoint")
    p.add_argument("--quiet", action="store_true", help="say less")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="skip the plot")
    p.add_argument("-o", "--opt", action="append", default=[], help="an option, repeatable")
    p.add_argument("--name", default="", help="a label")
    p.add_argument("--mode", choices=["a", "b"], default="a", help="the mode")
    return p


def option_lines(text: str) -> dict[str, str]:
    """Option -> its help line (argparse may wrap; the tests keep texts short enough not to)."""
    lines = {}
    for line in text.splitlines():
        words = line.split()
        if words and (words[0].startswith("-") or words[0] == "source"):
            lines[words[0].rstrip(",")] = " ".join(words)
    return lines


def test_defaults_only_where_they_mean_something():
    lines = option_lines(small_parser().format_help())
    assert lines["--epochs"].endswith("passes over the data (default: 8)")
    assert lines["--lr"].endswith("LR default: 0.05")  # no help text: the default alone
    assert lines["--out"].endswith("where results go (default: runs/train)")
    assert lines["--mode"].endswith("the mode (default: a)")
    assert lines["--workers"].endswith("processes (default: one per core)")  # the text already says it
    for quiet in ("--resume", "--quiet", "--no-plot", "-o", "--name", "source"):
        assert "default" not in lines[quiet], lines[quiet]  # None, a flag, [], "", a positional
    assert "None" not in small_parser().format_help()


def test_every_partrain_command_can_use_it():
    assert issubclass(HelpFormatter, argparse.HelpFormatter)
    assert "(default: None)" not in argparse.ArgumentParser(formatter_class=HelpFormatter).format_help()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"partrain {version('partrain')}\n"
    assert version("partrain") == partrain.__version__
