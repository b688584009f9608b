"""One benchmark run end to end through the command line, and the checks every benchmark's
output must pass: a smoke run said so, every goal printed, and a goals block with exactly the
issue's goal names, each ``{"value", "op", "target", "met", "interval"}`` with ``met`` agreeing
with a comparison made here (a goal not measured, value null, is not met)."""

from __future__ import annotations

import json
import math
from typing import Any

from partrain.cli import main


def run_and_check(name: str, goals: set[str], tmp_path: Any, capsys: Any, size: str = "--toy") -> tuple[str, dict]:
    """``partrain bench NAME SIZE --json FILE``: its printed output and its JSON, checked as above."""
    out_file = tmp_path / f"{name}.json"
    assert main(["bench", name, size, "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "smoke run: figures are noise" in out
    for goal in goals:
        assert any(line.startswith(goal) for line in out.splitlines()), f"goal {goal} not printed"
    data = json.loads(out_file.read_text())
    assert data["benchmark"] == name and data["smoke"] is True
    assert set(data["goals"]) == goals
    for goal, entry in data["goals"].items():
        assert set(entry) == {"value", "op", "target", "met", "interval"}, goal
        value, op, target = entry["value"], entry["op"], entry["target"]
        assert value is None or (isinstance(value, float) and math.isfinite(value)), goal
        assert op in (">=", "<=") and isinstance(target, float), goal
        expected = value is not None and (value >= target if op == ">=" else value <= target)
        assert entry["met"] is expected, goal
    return out, data
