"""``partrain rl serve / train / act``: bad options are one line and status 2, before any learner or actor starts;
an actor without a learner says that it waits, then fails after its reconnect timeout."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from partrain.cli import main

pytest.importorskip("gymnasium")

BAD = [
    (["serve", "--device", "gpu"], "Expected a device such as cpu, cuda, cuda:1 or auto. Received: 'gpu'"),
    *([] if torch.cuda.is_available() else [
        (["serve", "--device", "cuda"], "Expected a CUDA device for --device cuda. Received: none visible"),
        (["train", "--device", "cuda:0"], "Expected a CUDA device for --device cuda:0. Received: none visible"),
    ]),
    (["serve", "--port", "70000"], "Expected --port in 0..65535. Received: 70000"),
    (["serve", "--min-epochs", "2"], "Expected --min-epochs with --algorithm ppo. Received: --algorithm vtrace"),
    (["train", "--lr", "0"], "Expected --lr > 0. Received: --lr 0.0"),
    (["train", "--actors", "0"], "Expected --actors > 0. Received: --actors 0"),
    (["train", "--actor-nice", "20"], "Expected --actor-nice in 0..19. Received: 20"),
]


@pytest.mark.parametrize("argv, line", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_options_are_one_line_before_anything_starts(argv, line, tmp_path, capsys):
    assert main(["rl", *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("partrain rl: error: ") and line in err[0], err
    assert not (tmp_path / "run").exists()  # nothing written: no learner was built


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_act_with_an_unknown_environment_is_one_line_without_waiting_for_a_learner(capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    # the reconnect timeout would make a wait for the learner last a minute: the name is checked first
    assert main(["rl", "act", url, "--env", "NoSuchEnv-v0", "--reconnect-timeout", "60"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("partrain rl: error: Expected a gymnasium environment id"), err
    assert "'NoSuchEnv-v0'" in err[0]


def test_act_without_a_learner_says_it_waits_then_fails_after_the_reconnect_timeout(capsys, caplog):
    url = f"http://127.0.0.1:{closed_port()}"
    assert main(["rl", "act", url, "--env", "CartPole-v1", "--reconnect-timeout", "0.5", "--name", "a1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"partrain rl act: error: Expected a learner at {url}. Received: no answer for 0.5 s "
                       "(ConnectionRefusedError)"), err
    # one line when the outage began (pytest's log capture, or stderr where the CLI's handler took it)
    said = [m for m in [r.getMessage() for r in caplog.records] + err if "no learner answers" in m]
    assert len(said) == 1 and f"a1: no learner answers at {url}" in said[0], said


def test_an_actor_partrain_starts_runs_at_a_lower_cpu_priority(tmp_path):
    """`start_actor` (what `partrain rl train` and the benchmark use) lowers the actor's priority by
    `ACTOR_NICE` below this process's; ``nice=0`` leaves it at ours."""
    from partrain.rl.run import ACTOR_NICE, start_actor

    url = f"http://127.0.0.1:{closed_port()}"  # no learner: the actor waits for one, long enough to look
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    procs = [start_actor(url, "CartPole-v1", num_envs=1, mode="local", seed=0, token=None, name=f"a{nice}",
                         capture=True, nice=nice) for nice in (ACTOR_NICE, 0)]
    try:
        seen = [os.getpriority(os.PRIO_PROCESS, p.pid) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=30)
    assert seen == [min(19, ours + ACTOR_NICE), ours]
