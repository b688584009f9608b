"""The launcher: results in rank order, failures named by rank, no hangs, torchrun path.

A dead or failing peer must become an error naming its rank within the timeout,
never a hang: these tests run with short timeouts and pytest-timeout as a backstop.
"""

import os
import signal
import subprocess
import sys

import pytest
import torch

import partrain
from partrain.env import DistEnv, available_cores, cgroup_cpu_quota
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


def test_results_come_back_in_rank_order_with_the_cores_shared():
    out = partrain.launch(sum_ranks, 10, workers=2, timeout=30)
    assert [o[:3] for o in out] == [(0, 2, 21.0), (1, 2, 21.0)]
    # the cores this process may use, shared by 2 processes (1 each on 1 or 2 cores, 8 on 16)
    assert [o[3] for o in out] == [max(1, available_cores() // 2)] * 2
    assert [o[4] for o in out] == ["0", "1"]


def test_explicit_threads_win():
    assert [o[3] for o in partrain.launch(sum_ranks, 0, workers=2, threads=2, timeout=30)] == [2, 2]


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
@pytest.mark.fresh_processes
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


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
NONE_VISIBLE = "Received: none visible (torch.cuda.is_available() is False)"
BACKENDS = ", ".join(b for b in torch.distributed.Backend.backend_list if b != "undefined")

# (launch keywords, the same on the command line, the line) - each refused before a process starts
LAUNCH_ERRORS = [
    pytest.param({"device": "cuda"}, ["--device", "cuda"], f"Expected a CUDA device for --device cuda. {NONE_VISIBLE}",
                 marks=NO_CUDA),
    pytest.param({"device": "cuda:1"}, ["--device", "cuda:1"],
                 f"Expected a CUDA device for --device cuda:1. {NONE_VISIBLE}", marks=NO_CUDA),
    pytest.param({"backend": "nccl"}, ["--backend", "nccl"],
                 f"Expected a CUDA device for --backend nccl. {NONE_VISIBLE}", marks=NO_CUDA),
    ({"device": "gpu"}, ["--device", "gpu"], "Expected a device such as cpu, cuda, cuda:1 or auto. Received: 'gpu'"),
    ({"backend": "pigeon"}, None, f"Expected a backend among {BACKENDS}. Received: 'pigeon'"),
    ({"strategy": "single", "workers": 3}, ["--strategy", "single", "--workers", "3"],
     "Expected --workers 1 for strategy 'single'. Received: 3"),
    ({"threads": 0}, ["--threads", "0"], "Expected a positive number of threads. Received: threads=0"),
    ({"workers": None}, None, "Expected a positive number of workers. Received: workers=None"),  # torchrun's only
    ({"master_addr": "127.0.0.1"}, ["--master-addr", "127.0.0.1"],
     "Expected master_port with master_addr. Received: master_addr='127.0.0.1', master_port=None"),
    ({"timeout": float("nan")}, ["--timeout", "nan"],
     "Expected a positive, finite timeout in seconds. Received: timeout=nan"),
]


@pytest.mark.parametrize("kwargs,argv,expected", LAUNCH_ERRORS)
def test_what_the_launcher_can_check_is_refused_before_any_process_starts(kwargs, argv, expected, tmp_path,
                                                                          capsys):
    from partrain.cli import main

    pool = partrain.WorkerPool(4)  # starts its processes at the first job only
    with pytest.raises(UsageError) as info:
        partrain.launch(sum_ranks, 0, **{"workers": 2, "timeout": 30, "pool": pool, **kwargs})
    assert str(info.value) == expected
    assert repr(pool) == "WorkerPool(processes=4, alive=0)"  # nothing was started
    if argv is not None:  # the same from the command line: exit status 2, one line
        code = main(["train", "--quiet", "--epochs", "1", "--workers", "2", "--out", str(tmp_path), *argv])
        assert (code, capsys.readouterr().err.splitlines()) == (2, [f"partrain train: error: {expected}"])


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
def test_available_cores_follow_affinity_not_the_host():
    """Under taskset the launcher must count 1 core, whatever the host has."""
    code = "from partrain.env import available_cores; print(available_cores())"
    proc = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1"
    assert 1 <= available_cores() <= len(os.sched_getaffinity(0))


def test_cgroup_quota_caps_the_cores(tmp_path, monkeypatch):
    # v2: "quota period"; "max" is no limit
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    # v1: cfs quota / period; -1 is no limit
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    monkeypatch.setenv("PARTRAIN_CORES", "3")
    assert available_cores() == 3
    monkeypatch.setenv("PARTRAIN_CORES", "zero")
    with pytest.raises(UsageError, match="PARTRAIN_CORES"):
        available_cores()


@pytest.fixture()
def one_fake_gpu(monkeypatch):
    """What the launcher's checks see on a machine with one GPU (no GPU is touched: they only count)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize(("kwargs", "refused"), [
    ({}, True),  # auto: CUDA, so NCCL, and rank 1 would share cuda:0 with rank 0
    ({"device": "cuda"}, True),
    ({"backend": "nccl", "device": "cuda:0"}, True),
    ({"backend": "gloo"}, False),  # gloo shares a GPU (its collectives go through the host)
    ({"device": "cpu"}, False),
])
def test_nccl_with_more_workers_than_gpus_is_one_line_before_any_process_starts(one_fake_gpu, kwargs, refused):
    from partrain.env import check_ranks_per_gpu
    from partrain.launch import check_arguments

    if refused:
        with pytest.raises(UsageError) as info:
            check_arguments(2, 30, device=kwargs.get("device"), backend=kwargs.get("backend"))
        device = kwargs.get("device", "auto")
        assert str(info.value) == (f"Expected at most 1 worker(s) per machine with NCCL, one per GPU (1 visible for "
                                   f"--device {device}). Received: 2 workers; use --workers 1, or --backend gloo to "
                                   f"share a GPU, or --device cpu")
    else:
        check_arguments(2, 30, device=kwargs.get("device"), backend=kwargs.get("backend"))
    check_arguments(1, 30, device=kwargs.get("device"), backend=kwargs.get("backend"))  # one per GPU: fine
    check_ranks_per_gpu(3, "cpu")  # no GPU in use: nothing to share


def test_partrain_train_on_a_gpu_machine_defaults_to_one_worker_per_gpu(one_fake_gpu, monkeypatch, tmp_path):
    import partrain.train.cli as train_cli

    seen = {}

    def fake_fit(*args, **kwargs):  # stop where the worker count is decided: nothing runs on the fake GPU
        seen.update(kwargs)
        raise SystemExit(0)

    monkeypatch.setattr("partrain.train.fit.fit", fake_fit)
    monkeypatch.setattr(train_cli, "available_cores", lambda: 16)
    from partrain.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--quiet", "--epochs", "1", "--out", str(tmp_path)])
    assert seen["workers"] == 1
    seen.clear()
    with pytest.raises(SystemExit):
        main(["train", "--quiet", "--epochs", "1", "--out", str(tmp_path / "b"), "--backend", "gloo"])
    assert seen["workers"] == 16  # gloo: the cores, as on a CPU machine
