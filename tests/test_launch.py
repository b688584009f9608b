"""The launcher: results in rank order, failures named by rank, no hangs, torchrun path.

A dead or failing peer must become an error naming its rank within the timeout,
never a hang: these tests run with short timeouts and pytest-timeout as a backstop.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import partrain
from partrain.env import DistEnv
from partrain.errors import UsageError, WorkerError


def sum_ranks(strategy, offset):
    t = torch.tensor([float(strategy.rank + offset)])
    strategy.all_reduce_sum(t)
    return strategy.rank, strategy.num_workers, t.item(), torch.get_num_threads(), os.environ.get("RANK")


def raise_on_rank_1(strategy):
    if strategy.rank == 1:
        raise KeyError("missing thing")
    strategy.barrier()


def kill_rank_1_mid_run(strategy):
    for step in range(1000):
        if strategy.rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        t = torch.ones(1)
        strategy.all_reduce_sum(t)
        time.sleep(0.01)


def test_results_come_back_in_rank_order_with_one_thread_each():
    out = partrain.launch(sum_ranks, 10, workers=2, timeout=30)
    assert [o[:3] for o in out] == [(0, 2, 21.0), (1, 2, 21.0)]
    assert [o[3] for o in out] == [1, 1]  # 2 cores shared by 2 processes
    assert [o[4] for o in out] == ["0", "1"]


def test_single_worker_runs_in_process():
    out = partrain.launch(sum_ranks, 5, workers=1, strategy="single")
    assert [o[:3] for o in out] == [(0, 1, 5.0)]


def test_exception_in_a_rank_names_it_with_traceback():
    with pytest.raises(WorkerError) as info:
        partrain.launch(raise_on_rank_1, workers=2, timeout=20)
    err = info.value
    assert err.rank == 1 and "KeyError" in str(err) and "missing thing" in str(err)
    assert "raise_on_rank_1" in err.traceback


@pytest.mark.timeout(60)
def test_killed_worker_fails_the_job_naming_the_rank():
    # bounded by the pytest-timeout mark: a hang fails the test instead of the suite
    with pytest.raises(WorkerError) as info:
        partrain.launch(kill_rank_1_mid_run, workers=2, timeout=20)
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value)


def test_bad_arguments():
    with pytest.raises(UsageError, match="workers=0"):
        partrain.launch(sum_ranks, 0, workers=0)
    with pytest.raises(UsageError, match="strategy"):
        partrain.launch(sum_ranks, 0, workers=2, strategy="nope")


def test_distenv_reads_torchrun_variables(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    env = DistEnv.from_environ(device="cpu")
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.backend) == (3, 4, 1, 2, "gloo")
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(UsageError, match="RANK"):
        DistEnv.from_environ()


@pytest.mark.timeout(180)
def test_torchrun_path_trains(tmp_path):
    """The same CLI under torchrun: it joins torchrun's job instead of spawning."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "partrain", "train", "--epochs", "1", "--quiet", "--out", str(tmp_path), "--timeout", "60"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "test accuracy" in proc.stdout
    import json

    row = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[-1])
    assert row["workers"] == 2 and row["samples"] == 1438
