"""``partrain population`` end to end on the digits: outputs, best checkpoint, resume, errors.

The best member's checkpoint must load with the project's checkpoint reader
(what ``partrain serve`` uses) and its optimizer state must load into the
``torch.optim`` optimizer ``partrain train --resume`` builds.
"""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest
import torch

from partrain.checkpoint import load_checkpoint, load_model
from partrain.cli import main
from partrain.data.datasets import DataSpec, load_dataset


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
    # the served model takes raw digits (pixel values 0..16): the dataset's scaling is recorded with it
    assert spec["preprocess"]["scale"] == pytest.approx(1 / 6.4) and spec["preprocess"]["offset"] == -0.75
    served_model, _ = loading.model_from_checkpoint(str(tmp_path / "best.pt"))
    raw = torch.arange(64, dtype=torch.float32).reshape(1, 1, 8, 8) % 17
    with torch.no_grad():
        assert torch.allclose(served_model(raw), model((raw / 16 - 0.3) / 0.4), rtol=1e-5, atol=1e-4)


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


def _same_population(a_dir, b_dir, files) -> None:
    """Two population directories hold the same state, bit for bit (timings aside)."""
    for name in files:
        a = torch.load(a_dir / name, weights_only=True)
        b = torch.load(b_dir / name, weights_only=True)
        pa, pb = a["population"], b["population"]
        assert pa["steps"] == pb["steps"] and pa["members"] == pb["members"]
        for part in ("params", "buffers", "hparams"):
            assert pa[part].keys() == pb[part].keys()
            for k in pa[part]:
                assert torch.equal(pa[part][k], pb[part][k]), (name, part, k)
        for key, value in pa["optimizer_state"].items():
            if key == "step":
                assert torch.equal(value, pb["optimizer_state"][key])
            else:
                assert all(torch.equal(t, pb["optimizer_state"][key][k]) for k, t in value.items()), key
        assert a["loader"] == b["loader"]
        assert a["pbt"]["lineage"] == b["pbt"]["lineage"]
        assert torch.equal(a["pbt"]["generator"], b["pbt"]["generator"])
        untimed = [{k: v for k, v in r.items() if k != "samples_per_s"} for r in a["history"]]
        assert untimed == [{k: v for k, v in r.items() if k != "samples_per_s"} for r in b["history"]]


def test_resume_over_two_processes_equals_a_straight_run(tmp_path) -> None:
    """Issue 10: ``--workers 2`` then ``--resume`` failed with gloo's "Connection closed by peer".

    The cause: at the end of a run, fetching the best member to process 0 entered a broadcast
    on process 1 only when process 0 already owned that member. Here the 4 + 4 steps resumed
    over 2 processes equal 8 straight steps bit for bit (same process layout, thread count and
    operations in the same order; the engine is fixed, since ``auto`` picks by timing), PBT's
    history continues (its round at the checkpoint's step 4 runs after the resume) and both
    runs end with the best member fetched from whichever process owns it.
    """
    common = ["--members", "4", "--workers", "2", "--engine", "vmap", "--pbt-interval", "2",
              "--space", "lr=loguniform:1e-3:3e-1", "--space", "momentum=choice:0.0,0.5,0.9"]
    assert run(tmp_path / "straight", "--steps", "8", *common) == 0
    assert run(tmp_path / "resumed", "--steps", "4", *common) == 0
    first = torch.load(tmp_path / "resumed" / "population.rank1.pt", weights_only=True)
    assert run(tmp_path / "resumed", "--steps", "8", "--resume", *common) == 0
    _same_population(tmp_path / "straight", tmp_path / "resumed", ["population.pt", "population.rank1.pt"])
    after = torch.load(tmp_path / "resumed" / "population.rank1.pt", weights_only=True)
    assert first["population"]["steps"] == 4 and after["population"]["steps"] == 8
    rounds = sorted({r["step"] for r in after["pbt"]["lineage"]})
    assert rounds == [2, 4, 6]  # the round at step 4 ran after the resume; none after the last step
    assert after["pbt"]["lineage"][: len(first["pbt"]["lineage"])] == first["pbt"]["lineage"]
    assert [r["step"] for r in after["history"][::4]] == [2, 4, 6, 8]
    for name in ("straight", "resumed"):
        assert load_checkpoint(str(tmp_path / name / "best.pt"))["step"] == 8
    assert open(tmp_path / "straight" / "leaderboard.csv").read() == open(tmp_path / "resumed" / "leaderboard.csv").read()


FIX = "tests.population.fixtures"


@pytest.mark.parametrize("dataset, model, extra, shape, classes", [
    ("synthetic", "cnn", ["--synthetic-samples", "300", "--synthetic-shape", "2,6,6", "--synthetic-classes", "4"],
     [2, 6, 6], 4),
    ("{tmp}/data.npz", "mlp", [], [5], 3),
    (f"{FIX}:blobs", "mlp", [], [6], 3),
    (f"{FIX}:pairs", "mlp", [], [6], 3),
])
def test_dataset_option(tmp_path, dataset, model, extra, shape, classes) -> None:
    """``--dataset`` takes what ``partrain train --dataset`` takes; the best member's reported test
    accuracy is recomputed here from ``best.pt`` on the dataset's own test split."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.normal(size=(150, 5)).astype(np.float32), y=rng.integers(0, 3, 150))
    dataset = dataset.format(tmp=tmp_path)
    out = tmp_path / "run"
    assert run(out, "--members", "2", "--steps", "4", "--pbt-interval", "2", "--engine", "vmap",
               "--dataset", dataset, "--model", model, "--test-fraction", "0.25", *extra) == 0
    model_obj, spec = load_model(str(out / "best.pt"))
    assert spec["input_shape"] == shape and spec["num_classes"] == classes
    spec_data = DataSpec(name=dataset, samples=300, shape=(2, 6, 6), classes=4, test_fraction=0.25, seed=0)
    _, test = load_dataset(spec_data)
    x = torch.stack([torch.as_tensor(test[i][0]) for i in range(len(test))]).float()
    y = torch.tensor([int(test[i][1]) for i in range(len(test))])
    with torch.no_grad():
        accuracy = (model_obj.eval()(x).argmax(1) == y).double().mean().item()
    best = next(csv.DictReader(open(out / "leaderboard.csv")))
    assert float(best["test_accuracy"]) == round(accuracy, 4)
    assert load_checkpoint(str(out / "best.pt"))["config"]["dataset"] == dataset


def test_a_failure_on_one_process_is_reported_as_its_own(tmp_path, capsys) -> None:
    """Process 1's members raise mid-run while process 0 waits for it in a collective: the line
    names process 1's error, not process 0's echo of the closed connection."""
    code = main(["population", "--members", "4", "--workers", "2", "--steps", "6", "--pbt-interval", "2",
                 "--engine", "loop", "--model", f"{FIX}:fails_on_rank1", "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err == ["partrain population: error: worker rank 1 failed: RuntimeError: member forward failed on "
                   "purpose on process 1 (tests/population/fixtures.py:73, in forward)"]  # the user's line


def test_the_leaderboard_says_nan_for_a_diverged_member() -> None:
    """Not the tables' "-" (a missing value): a member whose loss is NaN diverged."""
    from partrain.population.report import format_leaderboard

    rows = [{"rank": 1, "member": 3, "val_loss": 0.25, "lr": 0.012345, "last_copied_from": ""},
            {"rank": 2, "member": 0, "val_loss": float("nan"), "lr": float("inf"), "last_copied_from": 3}]
    lines = format_leaderboard(rows).splitlines()
    assert lines[2].split() == ["1", "3", "0.25", "0.01235"], lines
    assert lines[3].split() == ["2", "0", "nan", "inf", "3"], lines
