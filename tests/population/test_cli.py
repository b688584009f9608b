"""``partrain population`` end to end on the digits: outputs, best checkpoint, resume, errors.

The best member's checkpoint must load with the project's checkpoint reader
(what ``partrain serve`` uses) and its optimizer state must load into the
``torch.optim`` optimizer ``partrain train --resume`` builds.
"""

from __future__ import annotations

import csv
import json
import os

import pytest
import torch

from partrain.cli import main
from partrain.train.checkpoint import load_checkpoint, load_model


def run(tmp_path, *extra: str) -> int:
    return main(["population", "--members", "3", "--out", str(tmp_path), "--quiet", *extra])


def test_cli_writes_every_output(tmp_path, capsys) -> None:
    assert run(tmp_path, "--steps", "6", "--pbt-interval", "3", "--space", "lr=loguniform:1e-2:1e-1",
               "--space", "momentum=choice:0.0,0.9") == 0
    out = capsys.readouterr().out
    assert "val_accuracy" in out and "best member" in out
    for name in ("leaderboard.csv", "history.csv", "lineage.jsonl", "curves.png", "best.pt", "population.pt"):
        assert os.path.getsize(tmp_path / name) > 0, name
    rows = list(csv.DictReader(open(tmp_path / "leaderboard.csv")))
    assert [int(r["rank"]) for r in rows] == [1, 2, 3]
    assert {"lr", "momentum", "test_accuracy"} <= set(rows[0])
    lineage = [json.loads(line) for line in open(tmp_path / "lineage.jsonl")]
    assert len(lineage) == 1 and lineage[0]["step"] == 3  # one round (none after the last step)
    assert {"src", "dst", "hparams_before", "hparams_after"} <= set(lineage[0])

    model, spec = load_model(str(tmp_path / "best.pt"))
    assert spec["name"] == "cnn" and spec["input_shape"] == [1, 8, 8] and spec["num_classes"] == 10
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    ckpt = load_checkpoint(str(tmp_path / "best.pt"))
    assert ckpt["step"] == 6 and ckpt["config"]["optimizer"] == "sgd"
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.load_state_dict(ckpt["optimizer"])  # what `partrain train --resume` does
    assert opt.param_groups[0]["lr"] == pytest.approx(ckpt["config"]["hparams"]["lr"])
    loading = pytest.importorskip("partrain.serve.loading")
    served = loading.load_model_spec(f"digits={tmp_path / 'best.pt'}")  # what `partrain serve` does
    assert served.name == "digits"


def test_resume_continues_exactly(tmp_path) -> None:
    """Bit for bit: both runs are this process, one thread (conftest), the same operations in order."""
    common = ["--engine", "vmap", "--pbt-interval", "2", "--optimizer", "adam"]
    assert run(tmp_path / "straight", "--steps", "6", *common) == 0
    assert run(tmp_path / "resumed", "--steps", "4", *common) == 0
    assert run(tmp_path / "resumed", "--steps", "6", "--resume", *common) == 0
    a = torch.load(tmp_path / "straight" / "population.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "population.pt", weights_only=True)
    assert b["population"]["steps"] == 6
    for k, v in a["population"]["params"].items():
        assert torch.equal(v, b["population"]["params"][k]), k
    assert a["pbt"]["lineage"] == b["pbt"]["lineage"]
    assert a["population"]["hparams"]["lr"].tolist() == b["population"]["hparams"]["lr"].tolist()


@pytest.mark.parametrize("args, match", [
    (["--members", "0"], "positive number of members"),
    (["--space", "lr=loguniform:0:1"], "Expected --space"),
    (["--space", "betas=0.9"], "hyperparameters among"),
    (["--steps", "0"], "positive number of steps"),
    (["--pbt-interval", "-1"], "pbt-interval"),
    (["--perturbation-factors", "a,b"], "perturbation-factors"),
    (["--model", "nope"], "Expected a model"),
    (["--resume"], "checkpoint to resume"),
    (["--workers", "9"], "--workers"),
])
def test_bad_input_is_one_line(tmp_path, capsys, args: list[str], match: str) -> None:
    assert main(["population", "--out", str(tmp_path / "x"), "--steps", "2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err
