"""`bench engines`' killed-worker run on a machine where the run ends before its kill lands.

The kill waits for checkpoints seen during the run, so on a fast machine a short run can
end first (issue 53: ``--quick`` ended in a traceback). The runs are injected here (no
process starts): the benchmark must run the killed variant again, longer, and say so in one
line, or report the recovery as not measured, never raise.
"""

from __future__ import annotations

import argparse

import pytest

from partrain.bench import engines


def args() -> argparse.Namespace:
    return argparse.Namespace(quick=True, toy=False, samples=None, epochs=None, rounds=None, checkpoint_every=None,
                              no_ray=True)


def fake_runs(monkeypatch, land_at: int | None) -> list[int]:
    """`_measure` answers at once; the killed run lands only with at least ``land_at`` samples."""
    tried: list[int] = []

    def measure(engine, work):
        rows = [{"samples_per_s": 1000.0, "seconds": 1.0}] * work.epochs
        if engine != engines.KILLED:
            return engines.Run(rows, 10.0, 2.0, None, work.samples)
        tried.append(work.samples)
        if land_at is None or work.samples < land_at:
            raise engines._NoKill(engines.Run(rows, 10.0, 2.0, None, work.samples))
        killed = {"since_checkpoint": 0.5, "killed_at": 100.0, "step": 10.0, "back_at": 104.0, "back_step": 12.0}
        return engines.Run(rows, 14.0, 2.0, killed, work.samples)

    monkeypatch.setattr(engines, "_measure", measure)
    return tried


def test_a_kill_that_came_too_late_runs_again_longer_and_says_so(monkeypatch):
    tried = fake_runs(monkeypatch, land_at=16000)
    report = engines.run(args())
    assert tried == [8000, 16000]
    assert any("ended before its kill landed on this machine; it ran again with 16,000 samples" in n
               for n in report.notes)
    goal = report.goals["engines.recovery_s"]
    # restart: back 4 s after the kill, minus 2 steps of 64 samples at 1000 samples/s; plus 0.5 s redone
    assert goal.value == pytest.approx(4.0 - 2 * 64 / 1000 + 0.5)


def test_a_kill_that_never_lands_is_one_line_not_a_traceback(monkeypatch):
    tried = fake_runs(monkeypatch, land_at=None)
    report = engines.run(args())
    assert tried == [8000, 16000, 32000]
    notes = [n for n in report.notes if n.startswith("recovery:")]
    assert notes == ["recovery: not measured: even at 32,000 samples every killed run ended before a worker was "
                     "killed and a checkpoint written after it (more --samples)"]
    assert report.goals["engines.recovery_s"].value is None
