"""docs/rl.md's outside actor, ``examples/rl_outside_actor.py``, runs as written against a learner.

The learner is ``partrain rl serve``; two copies of the example (one acting with local
weights, one through central inference) are started as plain ``python
examples/rl_outside_actor.py URL MODE`` processes. Once both have fed the learner (its
stats: frames, and central inference's calls), the learner is stopped with SIGTERM: both
must be told that training ended (410) and exit 0 with their summary line.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.waiting import wait_until

pytest.importorskip("gymnasium")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_documented_outside_actor_runs_in_both_modes(tmp_path):
    learner = subprocess.Popen(
        [sys.executable, "-m", "partrain", "rl", "serve", "--port", "0", "--out", str(tmp_path / "run"),
         "--report-every", "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    actors: list[subprocess.Popen] = []
    try:
        assert learner.stdout is not None
        first = learner.stdout.readline()
        match = re.search(r"at (http://\S+)", first)
        assert match, first
        url = match.group(1)
        actors = [subprocess.Popen([sys.executable, str(ROOT / "examples" / "rl_outside_actor.py"), url, mode],
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                  for mode in ("local", "central")]

        def both_fed() -> bool:
            row = httpx.get(f"{url}/rl/v1/stats", timeout=30).json()
            central_steps = sum(row["batch_sizes"].values())  # one inference call per central step
            return row["frames"] >= 4096 and central_steps >= 64 and row["version"] >= 2

        wait_until(both_fed, "segments from both actors", timeout=180, interval=0.2)
        learner.send_signal(signal.SIGTERM)
        out, _ = learner.communicate(timeout=120)
        assert learner.returncode == 143, out
        for mode, actor in zip(("local", "central"), actors):
            actor_out, _ = actor.communicate(timeout=60)
            assert actor.returncode == 0, (mode, actor_out)
            done = re.search(r"done: (\d+) frames sent, (\d+) weight versions pulled", actor_out)
            assert done and int(done.group(1)) > 0, (mode, actor_out)
            if mode == "local":
                assert int(done.group(2)) >= 1, actor_out  # it pulled the learner's new weights
    finally:
        for p in [learner, *actors]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
