"""An error that comes through the user's own code names the user's file and line in its one line.

Why this exists: when a user's dataset function or model raised, the CLI printed a traceback
wall (in the calling process) or one line naming partrain's frame (in a worker); the user's
file, line and message were visible only with ``-v``, 60 lines down. Now the one line carries
the exception's type and message and the innermost frame of the user's code; ``-v`` shows the
whole traceback. An error that never passed through the user's code is partrain's own: it keeps
its traceback.
"""

from __future__ import annotations

import inspect
import operator
import os

import pytest

from partrain.cli import main
from partrain.errors import exception_line, user_frame
from tests import data_fixtures


def _line_of(fn, text: str) -> str:
    """``tests/data_fixtures.py:N, in fn`` for the line of ``fn`` that holds ``text``."""
    lines, first = inspect.getsourcelines(fn)
    n = first + next(i for i, line in enumerate(lines) if text in line)
    return f"{os.path.relpath(inspect.getsourcefile(fn))}:{n}, in {fn.__name__}"


def _train(tmp_path, *args):
    return main(["train", "--quiet", "--epochs", "1", "--threads", "1", "--out", str(tmp_path / "run"), *args])


def test_a_failing_dataset_function_is_one_line_naming_its_file_and_line(tmp_path, capsys):
    code = _train(tmp_path, "--dataset", "tests.data_fixtures:missing_file_dataset")
    assert code == 1
    err = capsys.readouterr().err.splitlines()
    where = _line_of(data_fixtures.missing_file_dataset, "raise FileNotFoundError")
    assert err == [f"partrain train: error: FileNotFoundError: no such file: my_data.bin ({where}; "
                   "-v for the traceback)"]


def test_verbose_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError, match="my_data.bin"):
        main(["-v", "train", "--quiet", "--epochs", "1", "--out", str(tmp_path / "run"),
              "--dataset", "tests.data_fixtures:missing_file_dataset"])


def test_a_model_that_fails_in_a_worker_names_the_users_line(tmp_path, capsys):
    code = _train(tmp_path, "--workers", "2", "--dataset", "tests.data_fixtures:tiny_dataset",
                  "--model", "tests.data_fixtures:fails_in_workers")
    assert code == 1
    err = capsys.readouterr().err.splitlines()
    where = _line_of(data_fixtures.FailsInWorkers.forward, 'raise RuntimeError("a bug in my forward")')
    assert len(err) == 1, err
    assert err[0].startswith("partrain train: error: worker rank ")
    assert err[0].endswith(f" failed: RuntimeError: a bug in my forward ({where})")


def test_an_error_that_never_passed_through_user_code_keeps_its_traceback(tmp_path, monkeypatch):
    # itemgetter raises in C (a DataSpec is no sequence), called from partrain's own frames only
    monkeypatch.setattr("partrain.train.cli.load_dataset", operator.itemgetter(5))
    with pytest.raises(TypeError, match="not subscriptable"):
        _train(tmp_path)


def test_the_innermost_user_frame_is_the_one_named():
    def outer():
        return inner()

    def inner():
        raise KeyError("k")

    try:
        outer()
    except KeyError as exc:
        frame = user_frame(exc.__traceback__)
        line = exception_line(exc, "a hint")
    assert frame is not None and frame.name == "inner"
    assert line == f"KeyError: 'k' ({_line_of(inner, 'raise KeyError')}; a hint)"


def test_library_frames_are_not_the_users():
    import torch

    try:
        torch.zeros(2) @ torch.zeros(3)
    except RuntimeError as exc:
        frame = user_frame(exc.__traceback__)
    assert frame is not None and frame.filename == __file__  # this test is the user; torch is not
