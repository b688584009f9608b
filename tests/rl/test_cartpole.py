"""End to end: a learner and actor processes started with subprocess (not by partrain) solve CartPole.

The learner is ``python -m partrain rl serve --port 0``; actors are ``python -m
partrain rl act URL``, started here exactly as an outside program would. Once
training is under way one actor is SIGKILLed (it loses its unsent segment only) and
another joins; the learner must still reach a mean return of 475 over the last 20
episodes within a bounded number of frames (a frame bound, never a time bound: on a
slow machine it only takes longer), and every process must end on its own. A run
that collapses short of 475 is followed by one more with other seeds (`ATTEMPTS`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import warnings

import httpx
import pytest

from tests.waiting import wait_until

pytest.importorskip("gymnasium")

#: runs solve in 71-127k frames on an idle machine (seeds 0-9) but need more with the cores
#: oversubscribed, as the suite's other tests do it: 103-224k for seeds 0-5 beside 3 busy processes
#: (why load costs frames is not known; the policy lag stayed 1 at p50). A CI run had seed 0 at a
#: mean return of 251 and seed 1 at 416 when a 200k bound cut them off. The bound is the benchmark's,
#: 300k: room for a slow run, never a time bound.
MAX_FRAMES = 300_000
#: actor-critic runs across processes are not repeatable, and now and then one collapses after
#: nearing 475 and stays below it for hundreds of thousands of frames (one CI run: 452 at 72k
#: frames, 129 at 300k; 6 of 6 runs by hand solved in 71-135k): such a run is followed by a
#: second one with other seeds, and the test fails when no run solves. A broken runtime fails
#: every run. A CI run with a CPU-heavy test beside it had both of 2 runs short (9 and 118 at
#: 300k frames): 3 runs, each warned about when short.
ATTEMPTS = 3
PYTHON = [sys.executable, "-m", "partrain", "rl"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PARTRAIN_RL_TOKEN"] = "t0ken"
    env["OMP_NUM_THREADS"] = "1"
    return env


def start_actor(url: str, seed: int, name: str) -> subprocess.Popen:
    return subprocess.Popen([*PYTHON, "act", url, "--num-envs", "8", "--seed", str(seed), "--name", name],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def solve_once(tmp_path, seed: int) -> tuple[dict | None, str]:
    """One run: the learner's summary (None when it did not solve within MAX_FRAMES) and its output.

    Every check of the runtime is made here, whatever the run's luck."""
    summary = tmp_path / "summary.json"
    learner = subprocess.Popen(
        [*PYTHON, "serve", "--port", "0", "--target", "475", "--max-frames", str(MAX_FRAMES), "--seed", str(seed),
         "--out", str(tmp_path / "run"), "--json", str(summary), "--report-every", "5"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    actors: list[subprocess.Popen] = []
    try:
        assert learner.stdout is not None
        first = learner.stdout.readline()
        match = re.search(r"at (http://\S+)", first)
        assert match, first
        url = match.group(1)
        actors = [start_actor(url, 10 * seed + 1, "a1"), start_actor(url, 10 * seed + 2, "a2")]
        stats = lambda: httpx.get(f"{url}/rl/v1/stats", headers={"Authorization": "Bearer t0ken"},  # noqa: E731
                                  timeout=30).json()
        wait_until(lambda: stats()["version"] >= 20, "20 versions", timeout=300, interval=0.2)
        actors[0].send_signal(signal.SIGKILL)  # mid-run: it loses its unsent segment, nothing else
        actors[0].wait(30)
        at_kill = stats()["version"]
        actors.append(start_actor(url, 10 * seed + 3, "a3"))  # a newcomer joins a running learner
        out, _ = learner.communicate(timeout=500)
        assert learner.returncode == 0, out
        result = json.loads(summary.read_text())
        assert result["versions"] > at_kill
        for actor in actors[1:]:  # told "training ended" (410): they end on their own, status 0
            actor_out, _ = actor.communicate(timeout=60)
            assert actor.returncode == 0, actor_out
        assert (tmp_path / "run" / "curves.png").exists() and (tmp_path / "run" / "metrics.csv").exists()
        if result["solved_frames"] is None:
            return None, out
        assert result["solved_frames"] <= MAX_FRAMES and result["mean_return"] >= 475, out
        return result, out
    finally:
        for p in [learner, *actors]:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.mark.timeout(900)
def test_learner_and_outside_actors_solve_cartpole_despite_a_killed_actor(tmp_path):
    outputs = []
    for seed in range(ATTEMPTS):
        result, out = solve_once(tmp_path / f"seed{seed}", seed)
        if result is not None:
            return
        outputs.append(f"seed {seed}:\n{out}")
        # in the warnings summary of a passing run too: how often runs collapse is worth knowing
        warnings.warn(f"CartPole run with seed {seed} did not reach 475 within {MAX_FRAMES} frames "
                      f"({out.strip().splitlines()[-1] if out.strip() else 'no output'})", stacklevel=1)
    pytest.fail(f"no run of {ATTEMPTS} reached a mean return of 475 within {MAX_FRAMES} frames:\n"
                + "\n".join(outputs))
