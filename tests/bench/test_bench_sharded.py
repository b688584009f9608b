"""`partrain bench sharded` (issue 51, Measure): it runs at toy size, states its five goals, and its
width search finds what it says.

The full run takes minutes and is run by hand; here ``--toy`` runs end to end once (its figures
are noise and are not checked, only the goals block's names and form). The search
(`largest_width`) is checked against a hand-made limit, without any process. Start with
`test_toy_run_reports_the_five_goals`.
"""

from __future__ import annotations

import json
import math

import pytest

from partrain.bench.sharded import Shape, largest_width
from partrain.cli import main

GOALS = {"sharded.state_memory", "sharded.peak_memory", "sharded.largest_model", "sharded.step_vs_allreduce",
         "tp.scaling"}


@pytest.mark.timeout(240)
def test_toy_run_reports_the_five_goals(tmp_path, capsys):
    out_file = tmp_path / "sharded.json"
    assert main(["bench", "sharded", "--toy", "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "smoke run: figures are noise" in out and "fsdp, 2 processes" in out and "tp, 2 processes" in out
    for goal in GOALS:
        assert any(line.startswith(goal) for line in out.splitlines()), f"goal {goal} not printed"
    data = json.loads(out_file.read_text())
    assert data["benchmark"] == "sharded" and data["smoke"] is True
    assert set(data["goals"]) == GOALS
    for goal, entry in data["goals"].items():
        assert isinstance(entry["value"], float) and math.isfinite(entry["value"]), goal  # all five measured
        expected = entry["value"] >= entry["target"] if entry["op"] == ">=" else entry["value"] <= entry["target"]
        assert entry["met"] is expected, goal
    # the state is counted, not measured: fsdp's 2 workers hold half of the parameters' bytes each (the
    # toy GPT's rows split evenly), plus half of Adam's moments and the same step counters
    assert 0.45 < data["goals"]["sharded.state_memory"]["value"] <= 0.55


@pytest.mark.parametrize("limit", [31, 32, 100, 128, 500, 1000])
def test_the_search_finds_the_largest_multiple_that_fits(limit):
    widths, trials = [], []

    def fits(width):
        widths.append(width)
        return width <= limit

    found, trials = largest_width(fits, first=32, resolution=32, max_trials=20)
    assert found == (limit // 32) * 32
    assert [w for w, _ in trials] == widths and len(set(widths)) == len(widths)  # no width tried twice
    assert widths[:2] == [32, 64][:len(widths[:2])]  # doubling first


def test_the_search_stops_at_its_trial_budget():
    found, trials = largest_width(lambda w: True, first=32, resolution=32, max_trials=3)
    assert found == 128 and [w for w, _ in trials] == [32, 64, 128]


def test_parameter_count_needs_no_memory():
    shape = Shape(width=64, layers=2, heads=2, seq=16, batch=4)
    model = shape.model()
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
