"""`partrain train --model gpt --dataset text`: the language-model workload from the command line."""

from __future__ import annotations

import json

from partrain.cli import main


def test_the_built_in_gpt_trains_on_the_bundled_corpus_and_writes_a_sample(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--model", "gpt", "--dataset", "text", "--block-size", "32", "--model-opt", "n_embd=32",
                 "--model-opt", "n_layer=1", "--model-opt", "n_head=2", "--epochs", "2", "--samples-per-epoch", "128",
                 "--batch-size", "16", "--workers", "1", "--strategy", "single", "--out", str(out),
                 "--json", str(tmp_path / "run.json")])
    printed = capsys.readouterr().out
    assert code == 0
    assert "ppl" in printed and "tokens/s" in printed
    assert "sample (temperature 0.8, after the prompt in brackets):\n[" in printed
    summary = json.loads((tmp_path / "run.json").read_text())
    final = summary["final"]
    assert final["tokens"] == 128 * 32  # every target of the epoch's 128 samples of 32 tokens
    assert final["test_perplexity"] < 256  # better than a uniform guess over the bytes
    config = json.loads((out / "config.json").read_text())
    assert config["task"]["units"] == "tokens" and config["task"]["metrics"] == ["token_accuracy", "perplexity"]


def test_model_options_are_only_for_built_in_models(tmp_path, capsys):
    code = main(["train", "--model", "tests.helpers:small_mlp", "--model-opt", "depth=3", "--out", str(tmp_path / "r")])
    assert code == 2
    assert "Expected --model-opt with a built-in model" in capsys.readouterr().err
