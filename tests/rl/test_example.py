"""docs/rl.md's outside actor, ``examples/rl_outside_actor.py``, runs as written against a learner.

Its ``main(url, mode)`` runs twice, on threads of this process (one copy acting with
local weights, one through central inference), against a learner served on
127.0.0.1 (`partrain.rl.run.serving`, as ``partrain rl serve`` does). Once both have
fed the learner (frames, and central inference's calls), training stops: both must be
told that training ended (410) and return with their summary line. Real outside
processes are the CartPole test's (`test_cartpole.py`); here the example's own code is
what is checked, without three more process starts.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch

from tests.waiting import wait_until

pytest.importorskip("gymnasium")


@pytest.mark.timeout(300)
def test_the_documented_outside_actor_runs_in_both_modes(capsys):
    from examples.rl_outside_actor import main as outside_actor

    from partrain.rl.run import LearnerConfig, build_learner, serving

    threads_before = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):  # it seeds torch: leave this process's stream as it was
        learner = build_learner(LearnerConfig())  # CartPole-v1 on the CPU, one torch thread
    errors: dict[str, BaseException] = {}

    def act(url: str, mode: str) -> None:
        try:
            outside_actor(url, mode)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors[mode] = exc

    try:
        with serving(learner) as server:
            actors = [threading.Thread(target=act, args=(server.url, mode), name=f"example-{mode}")
                      for mode in ("local", "central")]
            for t in actors:
                t.start()
            training = threading.Thread(target=learner.train, kwargs={"timeout": 240}, name="learner")
            training.start()
            calls = server.app.state.batchers["policy"].stats.batch_sizes  # central inference: a call per step
            wait_until(lambda: learner.stats.frames >= 4096 and sum(dict(calls).values()) >= 64 or bool(errors),
                       "segments from both actors", timeout=180, interval=0.1)
            learner.stop()
            training.join(60)
            assert not training.is_alive()
        for t in actors:  # serving() answered 410 to both before it stopped the server
            t.join(60)
            assert not t.is_alive(), t.name
    finally:
        learner.stop()
        torch.set_num_threads(threads_before)
    assert not errors, errors
    out = capsys.readouterr().out
    done = re.findall(r"done: (\d+) frames sent, (\d+) weight versions pulled", out)
    assert len(done) == 2 and all(int(frames) > 0 for frames, _ in done), out
    assert max(int(pulled) for _, pulled in done) >= 1, out  # the local copy pulled new weights
