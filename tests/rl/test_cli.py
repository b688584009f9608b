"""``partrain rl serve / train``: bad options are one line and status 2, before any learner or actor starts."""

from __future__ import annotations

import pytest
import torch

from partrain.cli import main

pytest.importorskip("gymnasium")

BAD = [
    (["serve", "--device", "gpu"], "Expected a device such as cpu, cuda, cuda:1 or auto. Received: 'gpu'"),
    *([] if torch.cuda.is_available() else [
        (["serve", "--device", "cuda"], "Expected a CUDA device for --device cuda. Received: none visible"),
        (["train", "--device", "cuda:0"], "Expected a CUDA device for --device cuda:0. Received: none visible"),
    ]),
    (["serve", "--port", "70000"], "Expected --port in 0..65535. Received: 70000"),
    (["serve", "--min-epochs", "2"], "Expected --min-epochs with --algorithm ppo. Received: --algorithm vtrace"),
    (["train", "--lr", "0"], "Expected --lr > 0. Received: --lr 0.0"),
    (["train", "--actors", "0"], "Expected --actors > 0. Received: --actors 0"),
]


@pytest.mark.parametrize("argv, line", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_are_one_line_before_anything_starts(argv, line, tmp_path, capsys):
    assert main(["rl", *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("partrain rl: error: ") and line in err[0], err
    assert not (tmp_path / "run").exists()  # nothing written: no learner was built
