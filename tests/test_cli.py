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
        "--help", "--strategy", "--strategy-opt", "--mesh", "--workers", "--threads", "--backend", "--device",
        "--timeout",
        "--nnodes", "--node-rank", "--master-addr", "--master-port", "--model", "--dataset", "--target",
        "--synthetic-samples", "--synthetic-shape", "--synthetic-classes", "--test-fraction", "--sync-bn",
        "--model-opt", "--block-size", "--tokenizer", "--activation-checkpointing",
        "--epochs", "--batch-size", "--accumulate", "--lr", "--scale-lr", "--optimizer", "--momentum",
        "--weight-decay", "--max-steps", "--max-seconds", "--samples-per-epoch", "--seed", "--out", "--resume", "--quiet",
        "--loss", "--lr-schedule", "--warmup-steps", "--clip-grad", "--precision", "--on-nan", "--early-stop",
        "--monitor", "--overwrite", "--config", "--tensorboard", "--checkpoint-every", "--checkpoint-seconds",
        "--checkpoint-async",
        "--loader", "--loader-workers", "--prefetch", "--data-on-device", "--compile", "--json",
    ])


@pytest.fixture()
def files(tmp_path):
    np.savez(tmp_path / "flat.npz", x=np.zeros((10, 5), "float32"), y=np.zeros(10, "int64"))
    np.savez(tmp_path / "nox.npz", a=np.zeros(3))
    np.savez(tmp_path / "floaty.npz", x=np.zeros((10, 1, 8, 8), "float32"), y=np.zeros(10, "float32"))
    np.savez(tmp_path / "ragged.npz", x=np.zeros((10, 1, 8, 8), "float32"), y=np.zeros(9, "int64"))
    x = np.random.default_rng(0).normal(size=(20, 1, 8, 8)).astype("float32")
    y = np.arange(20) % 2
    bad = x.copy()
    bad[3, 0, 0, :2] = np.nan
    bad[7, 0, 1, 1] = np.nan  # 3 NaN values in 2 samples (wherever the split puts them: all in training below)
    np.savez(tmp_path / "nan_inputs.npz", x=np.concatenate([bad, x]), y=np.concatenate([y, y]))
    np.savez(tmp_path / "inf_targets.npz", x=x, y=np.where(np.arange(20) == 5, np.inf, 0.5).astype("float32"))
    np.savez(tmp_path / "nan_everywhere.npz", x=np.full((20, 1, 8, 8), np.nan, "float32"), y=y)
    np.savez(tmp_path / "three.npz", x=x[:3], y=y[:3])
    (tmp_path / "text.npz").write_text("not an archive")
    (tmp_path / "ckpt.pt").write_text("not a checkpoint")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.csv").write_text("epoch\n1\n")
    from partrain.checkpoint import save_checkpoint

    save_checkpoint(str(tmp_path / "done.pt"), {"model": {}, "model_spec": {"name": "cnn"}, "epoch": 1, "step": 9})
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
    (["--out", ""], "Expected --out to name a directory. Received: an empty string"),
    (["--out", "{d}/ckpt.pt"], "Expected --out to be a directory. Received: '{d}/ckpt.pt', which is a file"),
    (["--out", "{d}/run"], "Expected a new output directory (or resume / overwrite). Received: '{d}/run', which "
                           "holds a run (metrics.csv)"),
    (["--resume", "{d}/done.pt"], "Expected epochs above 1 to train on from '{d}/done.pt'. Received: a checkpoint "
                                  "at epoch 1 of epochs=1, which leaves nothing to train"),
    (["--strategy", "single", "--workers", "3"], "Expected --workers 1 for strategy 'single'. Received: 3"),
    (["--lr-schedule", "wavy"], "Expected an lr schedule among ['constant', 'cosine', 'linear', "
                                "'step:EPOCHS[:GAMMA]'] (e.g. step:3:0.5). Received: 'wavy'"),
    (["--warmup-steps", "-1"], "Expected warmup_steps to be a non-negative integer. Received: -1"),
    (["--clip-grad", "-1"], "Expected clip_grad to be a positive number or None. Received: -1.0"),
    (["--early-stop", "0"], "Expected a positive number of epochs without improvement. Received: early_stop=0"),
    (["--monitor", "test_acc"], "Expected monitor among ['epoch', 'step', 'lr', 'samples_per_s', 'train_loss', "
                                "'train_accuracy', 'test_loss', 'test_accuracy']. Received: 'test_acc'"),
    (["--config", "{d}/none.json"], "Expected --config to name a run's config.json. Received: '{d}/none.json'"),
    (["--config", "{d}/text.npz"], "Expected --config to be JSON (a run's config.json)"),
    (["--checkpoint-every", "0"], "Expected a positive number of steps between checkpoints. Received: "
                                  "checkpoint_every=0"),
    (["--max-seconds", "0"], "Expected max_seconds to be a positive number of seconds or None. Received: 0.0"),
    (["--checkpoint-seconds", "-1"], "Expected checkpoint_seconds to be a positive number of seconds or None. "
                                     "Received: -1.0"),
    (["--strategy", "ps", "--checkpoint-every", "5"], "Expected checkpoint_every / checkpoint_seconds with a strategy "
                                                      "whose workers agree on every step (allreduce, single). Received: "
                                                      "strategy 'ps', which checkpoints at epoch ends only"),
    (["--momentum", "nan"], "Expected finite, non-negative momentum and weight decay. Received: momentum=nan"),
    (["--master-addr", "127.0.0.1", "--master-port", "1", "--nnodes", "2", "--node-rank", "1", "--timeout", "2"],
     "Expected a reachable master at 127.0.0.1:1. Received: no answer within 2 s"),
    # data that makes any result meaningless: one line before the first step (issue 55, item 4)
    (["--dataset", "{d}/nan_inputs.npz"], "Expected finite values in the training set's inputs. Received: dataset "
     "'{d}/nan_inputs.npz' with 3 NaN values in 2 of"),
    (["--dataset", "{d}/inf_targets.npz"], "Expected finite values in the test set's targets. Received: dataset "
     "'{d}/inf_targets.npz' with 1 infinite value in 1 of 4 samples"),  # the seeded split holds it out
    (["--dataset", "{d}/nan_everywhere.npz", "--test-fraction", "0.5"], "with 640 NaN values in 10 of 10 samples (the "
     "first at sample 0; on_nan='skip' / --on-nan skip skips the steps they reach)"),
    # more of a newcomer's wrong inputs (issue 55, item 9)
    (["--model", "lenet5"], "Expected images of at least 12x12 for model 'lenet5' (its second 5x5 convolution and "
     "pooling need them). Received: 8x8 (model 'cnn' takes 8x8)"),
    (["--dataset", "synthetic", "--synthetic-samples", "-5"], "Expected a positive number of synthetic samples. "
     "Received: -5"),
    (["--dataset", "synthetic", "--synthetic-classes", "1"], "Expected at least 2 synthetic classes. Received: 1"),
    (["--target", "price"], "Expected a target column by name with a .csv dataset. Received: target='price' with "
     "dataset 'digits'"),
    (["--json", "{d}/no-such-dir/summary.json"], "Expected --json in an existing directory. Received: "
     "'{d}/no-such-dir/summary.json' ('{d}/no-such-dir' does not exist)"),
    (["--dataset", "{d}/three.npz", "--test-fraction", "0.5"], "Expected at least one training sample per worker (2). "
     "Received: dataset '{d}/three.npz' with 1 training sample (fewer workers, or more data)"),
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
    from partrain.checkpoint import load_model

    monkeypatch.setenv("PARTRAIN_CORES", "2")  # the default, one worker per core, bounded on any host
    code = main(["train", "--quiet", "--epochs", "4", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    acc = float(out.split("test accuracy: ")[1].split()[0])
    assert acc >= 0.9
    model, spec = load_model(str(tmp_path / "checkpoint.pt"))
    assert spec["name"] == "cnn" and spec["input_shape"] == [1, 8, 8]


def test_config_repeats_a_run_bit_for_bit_and_runs_are_never_overwritten(tmp_path, monkeypatch, capsys):
    """No --out: runs/train, then runs/train-2 (said in one line); --config takes every option but the output."""
    import torch

    from partrain.checkpoint import load_checkpoint

    monkeypatch.chdir(tmp_path)
    first = ["train", "--quiet", "--workers", "2", "--threads", "1", "--epochs", "1", "--model", "mlp",
             "--batch-size", "16", "--lr", "0.1", "--lr-schedule", "cosine", "--warmup-steps", "3",
             "--clip-grad", "1.0", "--seed", "5"]
    assert main(first) == 0
    config = json.load(open(tmp_path / "runs/train/config.json"))
    assert config["cli"]["lr"] == 0.1 and config["lr_schedule"] == "cosine" and config["seed"] == 5
    assert config["task"]["loss"] == "cross_entropy" and config["launch"]["workers"] == 2
    assert main(["train", "--config", "runs/train/config.json"]) == 0
    out = capsys.readouterr().out
    assert "partrain train: runs/train holds a run; writing runs/train-2" in out
    a = load_checkpoint(str(tmp_path / "runs/train/checkpoint.pt"))
    b = load_checkpoint(str(tmp_path / "runs/train-2/checkpoint.pt"))
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["metrics"][0]["train_loss"] == b["metrics"][0]["train_loss"]


def test_options_given_with_config_win_over_the_file(tmp_path):
    import argparse

    from partrain.train.cli import _apply_config

    (tmp_path / "config.json").write_text(json.dumps({"cli": {"seed": 5, "lr": 0.1, "epochs": 3, "out": "old"}}))
    sub = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    argv = ["train", "--config", str(tmp_path / "config.json"), "--seed=6", "--epoch", "4"]
    args = sub.parse_args(argv[1:], argparse.Namespace(argv=argv))
    _apply_config(args)
    assert (args.seed, args.epochs, args.lr, args.out) == (6, 4, 0.1, None)  # --epoch: a prefix of --epochs


def test_bench_json_path_is_checked_before_the_benchmark_runs(tmp_path, capsys, monkeypatch):
    import partrain.bench.core as core

    monkeypatch.setattr(core, "run", lambda args: pytest.fail("the benchmark ran before its --json path was checked"))
    path = tmp_path / "no" / "x.json"
    assert main(["bench", "core", "--json", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"partrain bench: error: Expected --json in an existing directory. Received: '{path}' "
                   f"('{path.parent}' does not exist)")


def test_a_run_that_ends_on_non_finite_figures_exits_non_zero(files, capsys):
    """--on-nan off trusts the numbers: the run goes on, but it cannot end with a summary and status 0."""
    code = main(["train", "--quiet", "--strategy", "single", "--epochs", "1", "--on-nan", "off",
                 "--dataset", str(files / "nan_everywhere.npz"), "--out", str(files / "out")])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""  # no summary line
    assert captured.err.splitlines() == [
        "partrain train: error: Expected finite figures at the end of the run. Received: train loss nan, test loss "
        "nan in the last epoch (--on-nan stop (the default) stops at the first non-finite loss; the epoch lines and "
        "metrics.csv show where they began)"]


def test_the_epoch_line_has_no_test_figures_without_a_test_set(capsys):
    from partrain.train.fit import fit
    from tests.data_fixtures import tiny_dataset, tiny_model
    from tests.helpers import sgd

    fit(tiny_model, (tiny_dataset(), None), sgd, strategy="single", epochs=1, checkpoint=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 1/1")]
    assert len(lines) == 1 and "loss" in lines[0] and "test" not in lines[0] and "nan" not in lines[0], lines


def test_a_shape_that_starts_with_a_dynamic_dim_is_a_value_not_an_option():
    from partrain.cli import negative_values

    assert negative_values(["serve", "m.pt", "--input-shape", "-1,3"]) == ["serve", "m.pt", "--input-shape=-1,3"]
    assert negative_values(["--input-shape", "-1x28x28", "-v"]) == ["--input-shape=-1x28x28", "-v"]
    assert negative_values(["--lr", "-1"]) == ["--lr", "-1"]  # one plain number: argparse's own rule takes it
    assert negative_values(["--input-shape=-1,3", "-1,3"]) == ["--input-shape=-1,3", "-1,3"]
    args = build_parser().parse_args(negative_values(["serve", "m.pt", "--input-shape", "-1,3"]))
    assert args.input_shape == "-1,3"


@pytest.mark.parametrize("argv,expected", [
    (["train", "--precision", "fp8"], "partrain train: error: argument --precision: invalid choice: 'fp8' (choose from "
     "'fp32', 'bf16') ('partrain train --help' lists the options)"),
    (["train", "--epochs", "two"], "partrain train: error: argument --epochs: invalid int value: 'two' ('partrain "
     "train --help' lists the options)"),
    (["bench", "nope"], "partrain bench: error: argument NAME: invalid choice: 'nope'"),
    (["serve"], "partrain serve: error: the following arguments are required: MODEL"),
])
def test_what_argparse_refuses_is_one_line_too(argv, expected, capsys):
    """argparse prints the whole usage (30 lines for train) before its error: here only the error."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(expected), err


def test_a_non_finite_loss_in_one_process_is_one_line_and_status_1(tmp_path, capsys):
    """A run in the caller's process (single, what a small job picks) stops on a NaN as a worker's
    does: one line, status 1, no traceback."""
    code = main(["train", "--quiet", "--strategy", "single", "--epochs", "1", "--lr", "1e30", "--out",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith("partrain train: error: Non-finite values at epoch 1, optimizer step ")


def test_an_epoch_smaller_than_one_global_batch_trains_and_says_so(tmp_path, capsys):
    code = main(["train", "--strategy", "single", "--epochs", "1", "--batch-size", "5000", "--out", str(tmp_path)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("partrain: an epoch")]
    assert code == 0 and err == ["partrain: an epoch holds 1,438 training samples, less than one global batch (5,000 "
                                 "per worker x 1 = 5,000): every epoch is one step on 1,438 samples (a smaller batch "
                                 "size gives more steps)"]
