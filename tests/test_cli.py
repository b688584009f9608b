"""`partrain` on the command line: help for every command, one clear line for bad input.

The table freezes what a user sees for each kind of bad input: exit status 2,
a single line on stderr that says what was expected and what was received,
no traceback - and no process is started before the input is checked.
"""

import json

import numpy as np
import pytest

from partrain.cli import build_parser, main


def test_help_explains_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    top = capsys.readouterr().out
    assert "train" in top and "bench" in top
    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in sub:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        assert len(capsys.readouterr().out) > 200, f"'partrain {name} --help' says too little"


def test_train_options_are_frozen():
    """New flags must be added on purpose: this list changes with them."""
    sub = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    flags = sorted(opt for a in sub._actions for opt in a.option_strings if opt.startswith("--"))
    assert flags == sorted([
        "--help", "--strategy", "--strategy-opt", "--workers", "--threads", "--backend", "--device", "--timeout",
        "--nnodes", "--node-rank", "--master-addr", "--master-port", "--model", "--dataset",
        "--synthetic-samples", "--synthetic-shape", "--synthetic-classes", "--test-fraction", "--sync-bn",
        "--epochs", "--batch-size", "--accumulate", "--lr", "--scale-lr", "--optimizer", "--momentum",
        "--weight-decay", "--max-steps", "--seed", "--out", "--resume", "--quiet",
        "--loss", "--lr-schedule", "--warmup-steps", "--clip-grad", "--precision", "--on-nan", "--early-stop",
        "--monitor", "--overwrite", "--config", "--tensorboard",
    ])


@pytest.fixture()
def files(tmp_path):
    np.savez(tmp_path / "flat.npz", x=np.zeros((10, 5), "float32"), y=np.zeros(10, "int64"))
    np.savez(tmp_path / "nox.npz", a=np.zeros(3))
    np.savez(tmp_path / "floaty.npz", x=np.zeros((10, 1, 8, 8), "float32"), y=np.zeros(10, "float32"))
    np.savez(tmp_path / "ragged.npz", x=np.zeros((10, 1, 8, 8), "float32"), y=np.zeros(9, "int64"))
    (tmp_path / "text.npz").write_text("not an archive")
    (tmp_path / "ckpt.pt").write_text("not a checkpoint")
    return tmp_path


ERRORS = [
    (["--workers", "0"], "Expected a positive number of workers. Received: --workers 0"),
    (["--strategy", "nope"], "Expected a strategy among"),
    (["-o", "nope=1"], "Received: nope"),
    (["-o", "bucket_cap_mb=big"], "Expected option bucket_cap_mb to be a float. Received: 'big'"),
    (["-o", "novalue"], "Expected a strategy option as KEY=VALUE"),
    (["--dataset", "{d}/missing.npz"], "(no such file)"),
    (["--dataset", "{d}/text.npz"], "not one"),
    (["--dataset", "{d}/nox.npz"], "Received arrays: ['a']"),
    (["--lr", "nan"], "Expected a positive, finite learning rate. Received: lr=nan"),
    (["--dataset", "{d}/ragged.npz"], "Expected x shaped (N, ...) and y shaped (N, ...)"),
    (["--dataset", "{d}/flat.npz"], "Received samples of shape (5,)"),
    (["--dataset", "tests.data_fixtures:tiny_dataset", "--model", "tests.data_fixtures:wrong_model"],
     "Received: dataset 'tests.data_fixtures:tiny_dataset' with inputs tensor (2, 6) float32"),
    (["--dataset", "mnist"], "Expected a dataset among"),
    (["--model", "resnet999"], "Expected a model among"),
    (["--model", "nosuchmodule_xyz:f"], "Expected module 'nosuchmodule_xyz' of model factory 'nosuchmodule_xyz:f' in the current directory, installed packages. Received: no module named 'nosuchmodule_xyz'"),
    (["--synthetic-shape", "a,b", "--dataset", "synthetic"], "Expected --synthetic-shape"),
    (["--lr", "-1"], "Expected a positive, finite learning rate. Received: lr=-1"),
    (["--epochs", "0"], "Expected a positive number of epochs"),
    (["--batch-size", "0"], "Expected a positive batch size"),
    (["--resume", "{d}/ckpt.pt"], "Expected '{d}/ckpt.pt' to be a partrain checkpoint"),
    (["--resume", "{d}/none.pt"], "Expected an existing checkpoint file"),
    (["--test-fraction", "1.5"], "Expected 0 < --test-fraction < 1"),
    (["--master-addr", "127.0.0.1", "--master-port", "1", "--nnodes", "2", "--node-rank", "1", "--timeout", "2"],
     "Expected a reachable master at 127.0.0.1:1. Received: no answer within 2 s"),
]


@pytest.mark.parametrize("argv,expected", ERRORS, ids=[" ".join(a)[:40] for a, _ in ERRORS])
def test_bad_input_is_one_clear_line(argv, expected, files, capsys):
    argv = [a.replace("{d}", str(files)) for a in argv]
    code = main(["train", "--quiet", "--workers", "2", "--epochs", "1", "--out", str(files / "out"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("partrain train: error: ")
    assert expected.replace("{d}", str(files)) in err


def test_train_user_model_and_data_from_modules(tmp_path, capsys):
    code = main(["train", "--quiet", "--workers", "2", "--epochs", "2", "--dataset", "tests.data_fixtures:tiny_dataset",
                 "--model", "tests.data_fixtures:tiny_model", "--lr", "0.1", "--out", str(tmp_path)])
    assert code == 0
    assert "test accuracy" in capsys.readouterr().out
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["workers"] == 2
    assert (tmp_path / "checkpoint.pt").exists() and (tmp_path / "curves.png").exists()


def test_default_train_reaches_high_accuracy_and_checkpoint_reloads(tmp_path, capsys, monkeypatch):
    from partrain.train.checkpoint import load_model

    monkeypatch.setenv("PARTRAIN_CORES", "2")  # the default, one worker per core, bounded on any host
    code = main(["train", "--quiet", "--epochs", "4", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    acc = float(out.split("test accuracy: ")[1].split()[0])
    assert acc >= 0.9
    model, spec = load_model(str(tmp_path / "checkpoint.pt"))
    assert spec["name"] == "cnn" and spec["input_shape"] == [1, 8, 8]
