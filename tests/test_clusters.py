"""Jobs other launchers start: Slurm's srun and Kubeflow's PyTorchJob.

partrain cannot run Slurm or Kubernetes here, so these tests give processes exactly
the variables those launchers set (srun's man page "OUTPUT ENVIRONMENT VARIABLES";
the PyTorchJob controller sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and no
LOCAL_RANK) and check that partrain reads them as a hand-worked example says, refuses
contradictions in one line, and that two such processes on this machine form one job.
Start reading at `partrain.env.external_job`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import partrain
from partrain.env import (
    DistEnv,
    ExternalJob,
    external_job,
    external_launcher,
    global_rank_from_environ,
    parse_hostlist,
    parse_tasks_per_node,
    slurm_port,
)
from partrain.errors import UsageError

LAUNCHER_PREFIXES = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_", "PARTRAIN_")


def clean_environ() -> dict[str, str]:
    """This process's environment without any launcher's variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_PREFIXES)}


@pytest.fixture
def no_launcher(monkeypatch):
    for key in list(os.environ):
        if key.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(key)
    return monkeypatch


# ----- parsers, against hand-expanded lists ---------------------------------------------

@pytest.mark.parametrize("text, hosts", [
    ("host", ["host"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu-a[1-2],gpu-b3", ["gpu-a1", "gpu-a2", "gpu-b3"]),
    ("n[8-10]", ["n8", "n9", "n10"]),  # no padding: widths grow
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padding kept, then outgrown
    ("r[1-2]-ib,login", ["r1-ib", "r2-ib", "login"]),  # a suffix after the bracket
    ("a,b,c", ["a", "b", "c"]),
    ("c[5]", ["c5"]),
])
def test_hostlist_expands_as_slurm_writes_it(text, hosts):
    assert parse_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "node[", "node[1-]", "n[3-1]", "a,,b", "n[x-2]", "n[1-2"])
def test_bad_hostlist_is_one_line(text):
    with pytest.raises(UsageError) as info:
        parse_hostlist(text, "SLURM_JOB_NODELIST")
    assert str(info.value) == ("Expected a Slurm host list such as node[01-04,07],gpu-b3 in "
                               f"$SLURM_JOB_NODELIST. Received: {text!r}")


@pytest.mark.parametrize("text, counts", [
    ("4", [4]), ("2(x3)", [2, 2, 2]), ("2,1", [2, 1]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]),
])
def test_tasks_per_node_expand(text, counts):
    assert parse_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "x", "0", "2(x0)", "2x3"])
def test_bad_tasks_per_node_is_one_line(text):
    with pytest.raises(UsageError) as info:
        parse_tasks_per_node(text, "SLURM_TASKS_PER_NODE")
    assert str(info.value) == f"Expected tasks per node such as 2(x3),1 in $SLURM_TASKS_PER_NODE. Received: {text!r}"


def test_slurm_port_is_documented_formula():
    assert [slurm_port(j) for j in (0, 1, 49999, 50000, 123456)] == [10000, 10001, 59999, 10000, 33456]


# ----- what each launcher's variables mean ------------------------------------------------

SRUN_4_ON_2_NODES = {  # srun -N2 -n4 on node[07-08], task 3: second task of the second node
    "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_JOB_ID": "123456",
}


def test_srun_variables(no_launcher):
    assert external_job(SRUN_4_ON_2_NODES) == ExternalJob("slurm", 3, 4, 1, 2, "node07", 33456)
    for key, value in SRUN_4_ON_2_NODES.items():
        no_launcher.setenv(key, value)
    env = DistEnv.from_environ(device="cpu")
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (external_launcher(), global_rank_from_environ()) == ("slurm", 3)


def test_srun_uneven_nodes_and_user_master():
    """'2,1': the second node runs one task; MASTER_ADDR/MASTER_PORT set by the user win."""
    environ = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
               "SLURM_STEPID": "1", "SLURM_TASKS_PER_NODE": "2,1", "SLURM_JOB_NODELIST": "gpu-a[1-2]",
               "SLURM_JOB_ID": "7", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    assert external_job(environ) == ExternalJob("slurm", 2, 3, 0, 1, "10.0.0.5", 29500)
    del environ["MASTER_ADDR"], environ["MASTER_PORT"]
    assert external_job(environ) == ExternalJob("slurm", 2, 3, 0, 1, "gpu-a1", 10007)


def test_srun_step_node_list_first():
    """A step on part of the allocation: its own node list and tasks per node describe it."""
    environ = {**SRUN_4_ON_2_NODES, "SLURM_STEP_NODELIST": "node[08-09]", "SLURM_JOB_NODELIST": "node[07-09]",
               "SLURM_TASKS_PER_NODE": "2(x3)"}
    assert external_job(environ) == ExternalJob("slurm", 3, 4, 1, 2, "node08", 33456)


def test_ntasks_per_node_alone():
    environ = {k: v for k, v in SRUN_4_ON_2_NODES.items() if "TASKS_PER_NODE" not in k}
    assert external_job({**environ, "SLURM_NTASKS_PER_NODE": "2"}) == ExternalJob("slurm", 3, 4, 1, 2, "node07",
                                                                                  33456)


@pytest.mark.parametrize("environ", [
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5"},  # a batch script: no srun step
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"},  # a one-task step: partrain spawns
    {},
])
def test_not_a_job_to_join(environ):
    assert external_job(environ) is None
    assert external_launcher(environ) is None and global_rank_from_environ(environ) == 0


def test_torchrun_wins_over_slurm():
    """torchrun inside an sbatch allocation: its variables describe the job."""
    environ = {**SRUN_4_ON_2_NODES, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
               "MASTER_ADDR": "node07", "MASTER_PORT": "29400"}
    assert external_job(environ) == ExternalJob("torchrun", 5, 8, 1, 4, "node07", 29400)


def test_pytorchjob_variables(no_launcher):
    """One process per pod: no LOCAL_RANK, so local rank 0 of 1 (cuda:0 in the pod)."""
    environ = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    assert external_job(environ) == ExternalJob("kubernetes", 1, 3, 0, 1, "job-master-0", 23456)
    for key, value in environ.items():
        no_launcher.setenv(key, value)
    env = DistEnv.from_environ(device="cpu")
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 3, 0, 1)
    assert (external_launcher(), global_rank_from_environ()) == ("kubernetes", 1)


def test_ranks_without_master_are_not_joined():
    """A process partrain.launch spawned has RANK/WORLD_SIZE but meets through partrain's own store."""
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert external_launcher(environ) is None and global_rank_from_environ(environ) == 1


SRUN_2 = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
          "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "9"}


@pytest.mark.parametrize("environ, line", [
    ({"RANK": "0"}, "Expected RANK and WORLD_SIZE together. Received: RANK='0', WORLD_SIZE=None"),
    ({"WORLD_SIZE": "2"}, "Expected RANK and WORLD_SIZE together. Received: RANK=None, WORLD_SIZE='2'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "Expected 0 <= RANK < WORLD_SIZE. Received: RANK=2, WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "Expected an integer in $RANK. Received: 'x'"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     "Expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE. Received: LOCAL_RANK=2, LOCAL_WORLD_SIZE=2, "
     "WORLD_SIZE=4"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
     "Expected 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE <= WORLD_SIZE. Received: LOCAL_RANK=0, LOCAL_WORLD_SIZE=4, "
     "WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"},
     "Expected MASTER_PORT with MASTER_ADDR. Received: MASTER_ADDR='h', MASTER_PORT=None"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"},
     "Expected a port between 1 and 65535 in $MASTER_PORT. Received: 70000"),
    ({**SRUN_2, "SLURM_PROCID": "2"}, "Expected 0 <= SLURM_PROCID < SLURM_NTASKS. Received: SLURM_PROCID=2, "
                                      "SLURM_NTASKS=2"),
    ({**SRUN_2, "SLURM_NTASKS": ""}, "Expected SLURM_NTASKS with SLURM_PROCID. Received: SLURM_PROCID='1', "
                                     "SLURM_NTASKS=None"),
    ({**SRUN_2, "SLURM_LOCALID": "2"},
     "Expected 0 <= SLURM_LOCALID < 2 (tasks on node 0 in $SLURM_TASKS_PER_NODE). Received: SLURM_LOCALID=2"),
    ({**SRUN_2, "SLURM_TASKS_PER_NODE": "1(x2)", "SLURM_NODEID": "1"},
     "Expected 0 <= SLURM_LOCALID < 1 (tasks on node 1 in $SLURM_TASKS_PER_NODE). Received: SLURM_LOCALID=1"),
    ({**SRUN_2, "SLURM_NODEID": "1"},
     "Expected 0 <= SLURM_NODEID < 1 (the nodes in $SLURM_TASKS_PER_NODE). Received: SLURM_NODEID=1"),
    ({**SRUN_2, "SLURM_TASKS_PER_NODE": "2(x2)"},
     "Expected $SLURM_TASKS_PER_NODE to add up to SLURM_NTASKS=2. Received: '2(x2)' (4 tasks)"),
    ({**SRUN_2, "SLURM_TASKS_PER_NODE": ""},
     "Expected SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE in an srun step. "
     "Received: none"),
    ({**SRUN_2, "SLURM_JOB_NODELIST": ""},
     "Expected MASTER_ADDR or SLURM_JOB_NODELIST in an srun step. Received: neither"),
    ({**SRUN_2, "SLURM_JOB_NODELIST": "n[1-"},
     "Expected a Slurm host list such as node[01-04,07],gpu-b3 in $SLURM_JOB_NODELIST. Received: 'n[1-'"),
    ({**SRUN_2, "SLURM_JOB_ID": ""}, "Expected MASTER_PORT or SLURM_JOB_ID in an srun step. Received: neither"),
])
def test_contradictions_are_one_line(environ, line):
    with pytest.raises(UsageError) as info:
        external_job(environ)
    assert str(info.value) == line


def test_contradiction_reaches_launch_as_one_line(no_launcher):
    import partrain

    no_launcher.setenv("RANK", "0")
    with pytest.raises(UsageError) as info:
        partrain.launch(print, workers=2)
    assert str(info.value) == "Expected RANK and WORLD_SIZE together. Received: RANK='0', WORLD_SIZE=None"


# ----- two processes on this machine, started as srun / a PyTorchJob would -----------------

JOIN_SCRIPT = """
import json, torch, partrain
from partrain.env import DistEnv

def body(strategy):
    t = torch.tensor([float(strategy.rank + 1)])
    strategy.all_reduce_sum(t)
    env = DistEnv.from_environ(device="cpu")
    return [strategy.rank, strategy.num_workers, t.item(), env.local_rank, env.local_world_size]

print(json.dumps(partrain.launch(body, workers=4, timeout=30)))
"""


def free_port(low: int = 1, high: int = 65536) -> int:
    """A port nothing listens on now, between ``low`` and ``high`` (the OS picks it)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if low <= port < high:
            return port
    raise AssertionError(f"no free port in [{low}, {high}) after 100 tries")


def run_ranks(environs: list[dict[str, str]], argv: list[str], timeout: float = 90) -> list[str]:
    """Start one process per environment at once; every one must exit 0. Returns their stdout."""
    base = {**clean_environ(), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, *argv], env={**base, **environ}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for environ in environs]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


def srun_environs() -> list[dict[str, str]]:
    """What `srun -N1 -n2` sets in its two tasks (no MASTER_*: partrain derives the port from the job id)."""
    job_id = str(free_port(10000, 60000) - 10000)  # so that slurm_port(job_id) is free now
    return [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r), "SLURM_NODEID": "0",
             "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
             "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost",
             "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_NNODES": "1"}
            for r in range(2)]


def pytorchjob_environs() -> list[dict[str, str]]:
    """What a PyTorchJob with a Master and one Worker sets in its two pods (no LOCAL_RANK)."""
    port = str(free_port())
    return [{"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for r in range(2)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [srun_environs, pytorchjob_environs], ids=["srun", "pytorchjob"])
def test_launch_joins_the_job(make):
    """Each task is one rank (workers=4 is ignored: nothing spawned); the all-reduce spans both."""
    outs = run_ranks(make(), ["-c", JOIN_SCRIPT])
    local_world = 2 if make is srun_environs else 1
    expected = [[r, 2, 3.0, r if local_world == 2 else 0, local_world] for r in range(2)]
    assert [json.loads(out.splitlines()[-1]) for out in outs] == [[row] for row in expected]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [srun_environs], ids=["srun"])  # a PyTorchJob joins by the same path (above)
def test_train_cli_joins_the_job(make, tmp_path):
    """`partrain train` in both tasks: one job of 2 workers, one --out, every sample seen once per epoch."""
    argv = ["-m", "partrain", "train", "--epochs", "1", "--dataset", "digits", "--quiet", "--out", str(tmp_path),
            "--timeout", "60"]
    run_ranks(make(), argv)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert (row["workers"], row["samples"]) == (2, 1438)


def test_fit_in_a_joined_job_takes_what_cannot_be_pickled(no_launcher, tmp_path):
    """Joining a job, `fit` runs in this process: nothing is sent to a worker, so a lambda or a
    closure is as good as a module-level function (Ray Train users write them inline)."""
    no_launcher.setenv("RANK", "0")
    no_launcher.setenv("WORLD_SIZE", "1")
    no_launcher.setenv("MASTER_ADDR", "127.0.0.1")
    no_launcher.setenv("MASTER_PORT", str(free_port()))
    width = 8
    result = partrain.fit(lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, width),
                                                      torch.nn.ReLU(), torch.nn.Linear(width, 10)),
                          "digits", lambda params: torch.optim.SGD(params, lr=0.1), epochs=1, quiet=True,
                          threads=1, out_dir=str(tmp_path))
    assert result.history[-1]["samples"] == 1438 and result.history[-1]["workers"] == 1
