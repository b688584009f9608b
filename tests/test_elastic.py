"""torchrun elastic restarts: a worker killed mid-run, the job re-forms, resumes the last
(mid-epoch) checkpoint and ends with the parameters of an uninterrupted run, bit for bit.

Both runs are 2 gloo processes with one intra-op thread each doing the same operations in
the same order: the uninterrupted one under partrain's own launcher, the other under
``torchrun --max-restarts 1`` with ``--resume auto`` (what a restarted attempt needs).
It is also the suite's test of the plain path: `partrain train` under torchrun joins
torchrun's job instead of spawning workers of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partrain.checkpoint import load_checkpoint
from partrain.cli import main

from .test_signals import _alive, _stat
from .waiting import wait_until

#: the C++ abort of a restarted rank, an open bug (see the test)
KNOWN_ABORT = "terminate called without an active exception"

TRAIN = ["-m", "partrain", "train", "--epochs", "2", "--quiet", "--threads", "1", "--model", "mlp", "--batch-size",
         "16", "--checkpoint-every", "5", "--timeout", "60", "--seed", "3"]


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None and stat[1] == pid and stat[0] != "Z":
            found.append(int(entry))
    return found


@pytest.mark.timeout(240)
def test_a_killed_worker_under_torchrun_restarts_and_ends_like_an_uninterrupted_run(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    # the uninterrupted reference: partrain's own launcher, in this process (the module's worker pool)
    assert main([*TRAIN[2:], "--workers", "2", "--out", str(tmp_path / "ref")]) == 0
    out = tmp_path / "elastic"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", *TRAIN, "--out", str(out), "--resume", "auto"]
    agent = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        wait_until(lambda: (out / "checkpoint.pt").exists() or agent.poll() is not None,
                   "the first mid-epoch checkpoint", timeout=120, interval=0.02)
        workers = children(agent.pid)
        assert len(workers) == 2 and agent.poll() is None, "the run ended before a worker could be killed"
        os.kill(workers[1], signal.SIGKILL)
        wait_until(lambda: not _alive(workers[1]), "the killed worker to be gone", timeout=30)
        stdout, stderr = agent.communicate(timeout=200)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    if agent.returncode != 0 and KNOWN_ABORT in stderr and "exitcode  : -6" in stderr:
        # Open bug (stops 60 and 61): now and then, under load, a rank of the restarted attempt
        # aborts in C++ at its start ("terminate called without an active exception", SIGABRT;
        # 1 of 5 suite runs in stop 61, never alone). Only that exact failure is tolerated here;
        # any other failure, a hang or a different result still fails the test.
        pytest.xfail(f"open bug: a rank of the restarted attempt aborted ({KNOWN_ABORT})")
    assert agent.returncode == 0, stderr[-3000:]
    a = load_checkpoint(str(tmp_path / "ref" / "checkpoint.pt"))
    b = load_checkpoint(str(out / "checkpoint.pt"))
    assert (b["epoch"], b["step"]) == (a["epoch"], a["step"]) and "within_epoch" not in b
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert [r["train_loss"] for r in b["metrics"]] == [r["train_loss"] for r in a["metrics"]]
