"""Every command writes its run under ``runs/`` and never over another run.

Why it exists: ``partrain rl`` wrote ``rl-run/`` (and ``partrain stream`` ``stream-run/``) at the
working directory's root, and one such directory ended up committed to the repository.
"""

from __future__ import annotations

import importlib

import pytest

from partrain.files import run_dir


@pytest.mark.parametrize("module", ["partrain.train.cli", "partrain.rl.cli", "partrain.stream.cli",
                                    "partrain.population.cli", "partrain.compare.cli"])
def test_each_commands_default_directory_is_under_runs(module):
    assert importlib.import_module(module).DEFAULT_OUT.startswith("runs/")


def test_a_default_directory_that_holds_a_run_gets_the_next_number(tmp_path, capsys):
    default = str(tmp_path / "runs" / "rl")
    assert run_dir(None, default, resume=False, command="rl") == default
    (tmp_path / "runs" / "rl").mkdir(parents=True)
    (tmp_path / "runs" / "rl" / "metrics.csv").write_text("x\n")
    assert run_dir(None, default, resume=False, command="rl") == f"{default}-2"
    assert capsys.readouterr().out == (f"partrain rl: {default} holds a run; writing {default}-2 (--out DIR to "
                                       "choose, --resume to continue)\n")
    assert run_dir(None, default, resume=True, command="rl") == default  # a resume continues it
    assert run_dir("elsewhere", default, resume=False, command="rl") == "elsewhere"
