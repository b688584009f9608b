"""`partrain compare` with fsdp and tp (issue 51, item 5): their memory per rank, and the one line
that says when a model only fits sharded.

What it guards: a strategy whose processes would hold more of the model's state than a process
has is skipped with the sizes in its reason, and the ones that split the state (fsdp, tp,
pipeline) then run unasked; each window reports its largest process's state, which fsdp and tp
halve over 2 workers (counted by hand on a tiny GPT). Start with
`test_a_model_that_only_fits_sharded_runs_fsdp_and_tp_and_says_so`.
"""

from __future__ import annotations

import json

import pytest
import torch

import partrain
from partrain.bench.compare import clusters
from partrain.cli import main
from partrain.compare.measure import Candidate, Measurement, fill_from_history
from partrain.compare.options import parse_memory
from partrain.compare.plan import MemoryFit, state_parts
from partrain.compare.run import applicable, warm_up
from partrain.errors import UsageError
from partrain.models import gpt

MiB = 2**20


@pytest.fixture(scope="module")
def _warm_pool(suite_pool):
    """The pool's processes import what a window needs before the budget starts (as test_compare.py)."""
    partrain.launch(warm_up, clusters(64, (1, 8, 8)), workers=2, threads=1)


def tiny_gpt():
    return gpt(vocab_size=256, n_layer=2, n_head=2, n_embd=16, block_size=16)


def test_memory_fit_by_hand():
    fit = MemoryFit(state_bytes=300 * MiB, available=200 * MiB, source="--memory-per-process")
    assert not fit.fits(1) and fit.fits(2) and fit.need(3) == 100 * MiB
    assert fit.line(2) == ("the model only fits sharded: 314.6MB of state per process replicated, about 157.3MB "
                           "split over 2 workers (fsdp, tp, pipeline), 209.7MB per process (--memory-per-process)")
    assert fit.line(1).startswith("the model does not fit even sharded: 314.6MB")
    assert MemoryFit(100 * MiB, 200 * MiB, "x").line(2) == ""
    assert fit.reason(1) == ("does not fit: about 314.6MB of parameters, gradients and optimizer state per "
                             "process, 209.7MB available (--memory-per-process)")
    assert [state_parts(Candidate(s, s, o), 4) for s, o in
            (("allreduce", {}), ("fsdp", {}), ("tp", {}), ("pipeline", {"stages": 2}))] == [1, 4, 4, 2]


def test_memory_sizes_parse_and_bad_ones_are_one_line():
    assert parse_memory("4GB") == 4e9 and parse_memory("512MiB") == 512 * MiB and parse_memory(None) is None
    with pytest.raises(UsageError, match=r"^Expected a positive memory size such as 4GB or 512MiB. Received: '4 "
                                         r"apples'$"):
        parse_memory("4 apples")


def test_replicated_strategies_that_do_not_fit_are_skipped_and_the_splitting_ones_run_unasked():
    model = tiny_gpt()
    default, _ = applicable(None, model, 2, 32, None)
    assert not {"fsdp", "tp"} & {c.label for c in default}  # opt-in while the model fits
    tight = MemoryFit(state_bytes=300 * MiB, available=200 * MiB, source="test")
    chosen, skipped = applicable(None, model, 2, 32, None, tight)
    assert {c.label for c in chosen} == {"fsdp", "tp", "pipeline"}
    reasons = {m.label: m.reason for m in skipped}
    assert "single" in reasons and "allreduce" in reasons and "hogwild" in reasons
    assert all(r.startswith("does not fit: about 314.6MB") for r in reasons.values()), reasons


def test_tp_on_a_model_its_plan_cannot_split_is_skipped_with_its_reason():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(8, 2))
    chosen, skipped = applicable(["allreduce", "tp"], model, 2, 32, None)
    assert [c.label for c in chosen] == ["allreduce"]
    assert [m.label for m in skipped] == ["tp"]
    assert skipped[0].reason.startswith("Expected a model tensor parallel can split automatically")


def test_a_window_reports_its_largest_process_state():
    m = Measurement("fsdp", "fsdp", {}, 2)
    row = {"samples": 64, "step": 2, "seconds": 1.0, "time_data": 0.0, "time_compute": 1.0, "time_comm": 0.0,
           "comm_bytes": 0, "train_loss": 1.0, "test_loss": 1.0,
           "memory_ranks": [{"params": 1 * MiB, "grads": 1 * MiB, "optimizer": 2 * MiB},
                            {"params": 2 * MiB, "grads": 2 * MiB, "optimizer": 4 * MiB}]}
    fill_from_history(m, [row], [], float("nan"))
    assert m.state_mb == 8.0


@pytest.mark.usefixtures("_warm_pool")
def test_a_model_that_only_fits_sharded_runs_fsdp_and_tp_and_says_so(tmp_path, capsys):
    """A GPT whose AdamW state is counted in the caller; a per-process memory between half of it and
    all of it: allreduce is skipped, fsdp and tp measured, each process holding about half of the
    state (that they run unasked is `applicable`'s, above: here they are named, so that the budget
    holds two windows)."""
    model = tiny_gpt()
    params = sum(p.numel() for p in model.parameters()) * 4
    state = params * 4  # parameters, gradients, Adam's two moments (its step counters aside)
    out = tmp_path / "cmp"
    code = main(["compare", "--model", "gpt", "--dataset", "text", "--block-size", "16",
                 "--model-opt", "n_embd=16", "--model-opt", "n_layer=2", "--model-opt", "n_head=2",
                 "--strategies", "allreduce,fsdp,tp", "--workers", "2", "--budget", "15s", "--memory-per-process",
                 str(int(state * 0.75)), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "the model only fits sharded:" in printed
    saved = json.loads((out / "compare.json").read_text())
    assert saved["memory_note"].startswith("the model only fits sharded:")
    rows = {s["label"]: s for s in saved["strategies"]}
    assert rows["allreduce"]["status"] == "skipped" and rows["allreduce"]["reason"].startswith("does not fit")
    for label in ("fsdp", "tp"):
        assert rows[label]["status"] == "ok", rows[label]
        # half of each tensor per rank, but what tp keeps whole (embeddings, norms) and Adam's step counters
        assert state / 2 / MiB * 0.99 <= rows[label]["state_mb"] < state / MiB * 0.75, (label, rows[label])
    assert rows["fsdp"]["state_mb"] <= state / 2 / MiB * 1.01
