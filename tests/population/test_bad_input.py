"""Bad input to ``partrain population``: one line, exit 2, and no process started.

Every row is a command line, the exit code and the exact line on stderr. The
launcher is replaced by one that fails the test, so a row passes only if the
parent caught the input before spawning (the rows use ``--workers 2`` where a
worker would otherwise have been the one to find out: there a failure on one
process reached the user as its peer's "Connection closed by peer").
``{out}`` is the run's output directory, ``{saved}`` a directory holding a
saved 4-member, 1-process, 4-step population (for the ``--resume`` rows).
"""

from __future__ import annotations

import importlib
import shutil

import numpy as np
import pytest
import torch

from partrain.cli import main

MODELS = "['bn-cnn', 'cnn', 'gpt', 'lenet5', 'mlp']"
SGD_NAMES = "['batch_size', 'dropout', 'lr', 'momentum', 'weight_decay']"
FIX = "tests.population.fixtures"
E = "partrain population: error: "

ROWS = [
    # options on their own
    (["--members", "0"], 2, "Expected a positive number of members. Received: --members 0"),
    (["--steps", "0"], 2, "Expected a positive number of steps. Received: --steps 0"),
    (["--epochs", "nan"], 2, "Expected a positive number of epochs. Received: --epochs nan"),
    (["--batch-size", "0"], 2, "Expected a positive number of samples per batch. Received: --batch-size 0"),
    (["--eval-interval", "0"], 2, "Expected a positive number of steps between evaluations. "
                                  "Received: --eval-interval 0"),
    (["--timeout", "0"], 2, "Expected a positive number of seconds. Received: --timeout 0.0"),
    (["--workers", "9"], 2, "Expected 1 <= --workers <= --members (8). Received: --workers 9"),
    (["--workers", "0"], 2, "Expected 1 <= --workers <= --members (8). Received: --workers 0"),
    (["--pbt-interval", "-1"], 2, "Expected --pbt-interval >= 0 (0: off). Received: -1"),
    (["--quantile-fraction", "0.7"], 2, "Expected 0 <= --quantile-fraction <= 0.5. Received: 0.7"),
    (["--resample-probability", "2"], 2, "Expected 0 <= --resample-probability <= 1. Received: 2.0"),
    (["--perturbation-factors", "a,b"], 2, "Expected --perturbation-factors as positive numbers separated by "
                                           "commas. Received: 'a,b'"),
    (["--perturbation-factors", "1.2,-1"], 2, "Expected --perturbation-factors as positive numbers separated "
                                              "by commas. Received: '1.2,-1'"),
    (["--test-fraction", "1"], 2, "Expected 0 < --test-fraction < 1. Received: 1.0"),
    (["--synthetic-samples", "0"], 2, "Expected a positive number of samples. Received: --synthetic-samples 0"),
    (["--synthetic-shape", "1,x"], 2, "Expected --synthetic-shape as positive integers separated by commas. "
                                      "Received: '1,x'"),
    (["--optimizer", "adam", "--nesterov"], 2, "Expected --nesterov only with --optimizer sgd. "
                                               "Received: --optimizer adam"),
    (["--out", ""], 2, "Expected --out to name a directory. Received: an empty string"),
    (["--out", "{out}/file"], 2, "Expected --out to be a directory. Received: '{out}/file', which is a file"),
    (["--out", "{saved}"], 2, "Expected a new output directory (or resume / overwrite). Received: '{saved}', which "
                              "holds a run (population.pt, leaderboard.csv, history.csv, best.pt, curves.png)"),
    # the search space
    (["--space", "lr=loguniform:0:1"], 2, "Expected --space lr=loguniform:LOW:HIGH (0 < LOW <= HIGH), "
     "uniform:LOW:HIGH, randint:LOW:HIGH, choice:V1,V2,... or a number. Received: 'lr=loguniform:0:1'"),
    (["--workers", "2", "--space", "betas=0.9"], 2,
     f"Expected --space names among {SGD_NAMES} for --optimizer sgd. Received: 'betas'"),
    (["--workers", "2", "--space", "lr=uniform:-1:1"], 2,
     "Expected --space lr within the values lr can take (>= 0). Received: uniform:-1:1"),
    (["--space", "momentum=choice:0.9,-0.5"], 2,
     "Expected --space momentum within the values momentum can take (>= 0). Received: choice:0.9,-0.5"),
    (["--optimizer", "adam", "--space", "beta1=uniform:0.5:1"], 2,
     "Expected --space beta1 within the values beta1 can take (in [0, 1)). Received: uniform:0.5:1"),
    (["--workers", "2", "--space", "batch_size=randint:8:5000"], 2,
     "Expected --space batch_size at most 1150 (the training samples). Received: randint:8:5000"),
    (["--workers", "2", "--space", "dropout=uniform:0:0.5"], 2,
     "Expected a model with nn.Dropout layers for --space dropout. Received: a model without any"),
    # data and model: loaded and run on a sample in the parent
    (["--workers", "2", "--batch-size", "5000"], 2,
     "Expected --batch-size <= 1150 (the training samples after holding out validation). Received: --batch-size 5000"),
    (["--workers", "2", "--eval-interval", "3"], 2,
     "Expected --pbt-interval to be a multiple of --eval-interval. Received: --pbt-interval 50, --eval-interval 3"),
    (["--model", "nope"], 2, f"Expected a model among {MODELS} or 'module:function'. Received: 'nope'"),
    (["--workers", "2", "--model", "lenet5"], 2,
     "Expected images of at least 12x12 for model 'lenet5' (its second 5x5 convolution and pooling need them). "
     "Received: 8x8 (model 'cnn' takes 8x8)"),
    (["--dataset", "nope"], 2, "Expected a dataset among 'digits', 'synthetic', a path ending in .npz or .csv, "
                               "'text', 'text:PATH' (a text file or directory), or 'module:function'. Received: 'nope'"),
    (["--workers", "2", "--dataset", f"{FIX}:regression", "--model", "mlp"], 2,
     "Expected integer class labels: partrain population trains classifiers (cross-entropy) and does not "
     f"support regression targets. Received: torch.float32 targets in dataset '{FIX}:regression' (train split)"),
    (["--workers", "2", "--dataset", "{out}/negative.npz", "--model", "mlp"], 2,
     "Expected class labels >= 0 in dataset '{out}/negative.npz' (train split). Received: -1"),
    (["--dataset", f"{FIX}:dicts", "--model", "mlp"], 2,
     f"Expected (input, class label) samples in dataset '{FIX}:dicts' (train split). Received: dict"),
    (["--workers", "2", "--dataset", f"{FIX}:blobs", "--model", "cnn"], 2,
     "Model 'cnn' expects square images shaped (channels, size, size). Received samples of shape (6,)"),
    # --resume: every process's checkpoint against the command line
    (["--resume"], 2, "Expected a population checkpoint to resume from. Received: '{out}/population.pt' (no such file)"),
    (["--out", "{saved}", "--resume", "--members", "4", "--steps", "4"], 2,
     "Expected --steps (or --epochs) beyond the 4 steps the saved population has trained, for --resume to train "
     "further. Received: 4 steps"),
    (["--out", "{saved}", "--resume", "--members", "6", "--steps", "8"], 2,
     "Expected --members 4 as in the saved population ({saved}/population.pt). Received: --members 6"),
    (["--out", "{saved}", "--resume", "--members", "4", "--steps", "8", "--workers", "2"], 2,
     "Expected --workers 1 as in the saved population ({saved}/population.pt). Received: --workers 2"),
    (["--out", "{saved}", "--resume", "--members", "4", "--steps", "8", "--optimizer", "adam"], 2,
     "Expected --optimizer sgd as in the saved population ({saved}/population.pt). Received: --optimizer adam"),
    (["--out", "{saved}", "--resume", "--members", "4", "--steps", "8", "--model", "mlp"], 2,
     "Expected --model cnn as in the saved population ({saved}/population.pt). Received: --model mlp"),
    (["--out", "{saved}", "--resume", "--members", "4", "--steps", "8", "--seed", "1"], 2,
     "Expected --seed 0 as in the saved population ({saved}/population.pt). Received: --seed 1"),
    (["--out", "{saved}", "--resume", "--members", "4", "--steps", "8", "--dataset", "synthetic"], 2,
     "Expected --dataset digits as in the saved population ({saved}/population.pt). Received: --dataset synthetic"),
    (["--out", "{saved}", "--resume", "--members", "4", "--steps", "8", "--space", "batch_size=randint:8:16"], 2,
     "Expected --space names among the saved population's hyperparameters ['lr', 'momentum', 'weight_decay']. "
     "Received: ['batch_size']"),
    (["--out", "{saved}/two", "--resume", "--members", "4", "--steps", "8", "--workers", "2"], 2,
     "Expected process 1's population checkpoint next to '{saved}/two/population.pt'. Received: "
     "'{saved}/two/population.rank1.pt' (no such file)"),
    (["--out", "{saved}/torn", "--resume", "--members", "4", "--steps", "8", "--workers", "2"], 2,
     "Expected every process's population checkpoint at the same step. Received: population.pt at step 4, "
     "population.rank1.pt at step 2 (a run stopped while saving); resume is not possible from these files"),
    (["--out", "{saved}/garbage", "--resume", "--members", "4", "--steps", "8"], 2,
     "Expected a readable population checkpoint. Received: '{saved}/garbage/population.pt' ..."),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A saved population (4 members, 1 process, 4 steps) and broken copies of it."""
    root = tmp_path_factory.mktemp("saved")
    assert main(["population", "--members", "4", "--steps", "4", "--pbt-interval", "2", "--engine", "vmap",
                 "--out", str(root), "--quiet"]) == 0
    state = torch.load(root / "population.pt", weights_only=True)
    two = root / "two"  # says it was written by 2 processes, but process 1's file is missing
    two.mkdir()
    state["config"]["workers"] = 2
    torch.save(state, two / "population.pt")
    torn = root / "torn"  # process 1's file from an earlier evaluation than process 0's
    shutil.copytree(two, torn)
    early = dict(state, population=dict(state["population"], steps=2))
    torch.save(early, torn / "population.rank1.pt")
    garbage = root / "garbage"
    garbage.mkdir()
    (garbage / "population.pt").write_bytes(b"not a checkpoint")
    return str(root)


@pytest.mark.parametrize("args, code, line", ROWS, ids=[" ".join(r[0])[:60] for r in ROWS])
def test_bad_input_is_one_line_before_any_process(tmp_path, capsys, monkeypatch, saved, args, code, line) -> None:
    def no_spawn(*a, **k):
        raise AssertionError("a process was started for bad input")

    # the module, not the function `partrain.launch` that the package re-exports under its name
    monkeypatch.setattr(importlib.import_module("partrain.launch"), "launch", no_spawn)
    out = str(tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "file").write_text("")
    np.savez(tmp_path / "out" / "negative.npz", x=np.zeros((20, 4), np.float32), y=np.full(20, -1))
    fill = {"out": out, "saved": saved}
    argv = ["population", "--out", out, "--quiet", *(a.format(**fill) for a in args)]
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    want = E + line.format(**fill)
    assert len(err) == 1, err
    if want.endswith(" ..."):
        assert err[0].startswith(want[:-4]), err[0]
    else:
        assert err[0] == want


def test_population_options_are_frozen() -> None:
    """New flags must be added on purpose: this list changes with them."""
    from partrain.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["population"]  # type: ignore[union-attr]
    flags = sorted(opt for a in sub._actions for opt in a.option_strings if opt.startswith("--"))
    assert flags == sorted([
        "--help", "--members", "--space", "--optimizer", "--nesterov", "--model", "--dataset",
        "--synthetic-samples", "--synthetic-shape", "--synthetic-classes", "--test-fraction", "--engine",
        "--steps", "--epochs", "--batch-size", "--pbt-interval", "--eval-interval", "--quantile-fraction",
        "--perturbation-factors", "--resample-probability", "--metric", "--workers", "--timeout", "--out",
        "--seed", "--resume", "--quiet", "--overwrite",
    ])
