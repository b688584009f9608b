"""WorkerPool: processes reused across launches, each launch still a fresh job.

Guards what reuse must not change: results, a fresh process group per launch, the
caller's current environment, and recovery after a job whose rank failed or died.
"""

import os
import re
import signal

import pytest
import torch

import partrain
from partrain.errors import UsageError, WorkerError
from partrain.pool import no_pool


def pid_and_sum(strategy, value):
    t = torch.tensor([float(value)])
    strategy.all_reduce_sum(t)
    return os.getpid(), t.item(), os.environ.get("PARTRAIN_TEST_MARK")


def fail_on_rank_1(strategy, how):
    if strategy.rank == 1:
        if how == "raise":
            raise KeyError("boom")
        os.kill(os.getpid(), signal.SIGKILL)
    strategy.barrier()


def signal_self_on_rank_1(strategy, signum):
    if strategy.rank == 1:
        os.kill(os.getpid(), signum)  # delivered at once: the handler runs before the next line
    t = torch.ones(1)
    strategy.all_reduce_sum(t)
    return t.item()


def test_processes_are_reused_and_each_launch_is_a_fresh_job(suite_pool, monkeypatch):
    first = partrain.launch(pid_and_sum, 1, workers=2, timeout=30)
    monkeypatch.setenv("PARTRAIN_TEST_MARK", "now")  # set after the processes started
    second = partrain.launch(pid_and_sum, 2, workers=2, timeout=30, pool=suite_pool)
    assert [o[1] for o in first] == [2.0, 2.0] and [o[1] for o in second] == [4.0, 4.0]
    assert [o[0] for o in first] == [o[0] for o in second]  # the same two processes
    assert len({o[0] for o in first}) == 2 and os.getpid() not in {o[0] for o in first}
    assert [o[2] for o in second] == ["now", "now"]  # the caller's environment of the moment


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failed_job_is_reported_and_the_pool_recovers(how):
    before = partrain.launch(pid_and_sum, 0, workers=2, timeout=30)
    with pytest.raises(WorkerError) as info:
        partrain.launch(fail_on_rank_1, how, workers=2, timeout=20)
    assert info.value.rank == 1
    after = partrain.launch(pid_and_sum, 3, workers=2, timeout=30)
    assert [o[1] for o in after] == [6.0, 6.0]
    assert after[1][0] != before[1][0]  # the failed rank's process was replaced


def test_outside_the_pool_and_limits(suite_pool):
    pooled = partrain.launch(pid_and_sum, 0, workers=2, timeout=30)
    with no_pool():
        fresh = partrain.launch(pid_and_sum, 0, workers=2, timeout=30)
    assert {o[0] for o in pooled}.isdisjoint(o[0] for o in fresh)
    n = suite_pool.processes
    with pytest.raises(UsageError, match=f"at most {n} processes on this pool. Received: {n + 1}"):
        partrain.launch(pid_and_sum, 0, workers=n + 1, timeout=30)
    closed = partrain.WorkerPool(2)
    closed.close()
    assert "alive=0" in repr(closed)
    with pytest.raises(UsageError, match="open WorkerPool"):
        partrain.launch(pid_and_sum, 0, workers=2, pool=closed)
    with pytest.raises(UsageError, match="processes=0"):
        partrain.WorkerPool(0)


def test_an_unpicklable_job_is_one_line_and_the_pool_goes_on():
    with pytest.raises(UsageError, match="Expected the function and arguments of a launch to be picklable"):
        partrain.launch(pid_and_sum, lambda: 1, workers=2, timeout=30)
    assert [o[1] for o in partrain.launch(pid_and_sum, 1, workers=2, timeout=30)] == [2.0, 2.0]


def test_a_worker_ignores_ctrl_c_and_stops_on_sigterm():
    """The caller owns its processes: Ctrl-C (SIGINT to the terminal's whole group) is the
    caller's to act on, so a worker goes on; SIGTERM, how the caller stops a worker, unwinds
    its job (``finally`` blocks run) and names the rank."""
    assert partrain.launch(signal_self_on_rank_1, signal.SIGINT, workers=2, timeout=30) == [2.0, 2.0]
    with pytest.raises(WorkerError) as info:
        partrain.launch(signal_self_on_rank_1, signal.SIGTERM, workers=2, timeout=20)
    # the summary names where the worker was when the signal came: the user's line
    assert info.value.rank == 1
    assert re.fullmatch(r"Interrupted: stopped by SIGTERM \(tests/test_pool\.py:\d+, in signal_self_on_rank_1\)",
                        info.value.summary)
    assert partrain.launch(signal_self_on_rank_1, signal.SIGINT, workers=2, timeout=30) == [2.0, 2.0]


def stacks_on_sigusr1(strategy):
    """This process's stderr while it sends itself SIGUSR1, then a collective (the job goes on)."""
    import tempfile

    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler (C, faulthandler's) runs before the next line
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        written = out.read().decode(errors="replace")
    t = torch.ones(1)
    strategy.all_reduce_sum(t)
    return written, t.item()


def test_sigusr1_writes_every_threads_stack_and_the_job_goes_on():
    """``kill -USR1`` on a worker that seems stuck shows where each of its threads is."""
    results = partrain.launch(stacks_on_sigusr1, workers=2, timeout=30)
    for written, total in results:
        assert total == 2.0
        assert "stacks_on_sigusr1" in written and "test_pool.py" in written
        assert "Current thread" in written and "in watch" in written  # every thread: the parent watch's too


def collective_on_rank_1_only(strategy):
    import torch.distributed as dist

    if strategy.rank == 1:  # a path the other rank does not take: it returns, this one waits on it
        dist.all_reduce(torch.ones(1))
    return strategy.rank


def test_a_collective_entered_by_one_rank_alone_is_named_as_such():
    """No rank failed: the one left waiting reports the lost peer, and the report says the others returned."""
    with pytest.raises(WorkerError) as e:
        partrain.launch(collective_on_rank_1_only, workers=2, timeout=20)
    assert e.value.rank == 1
    assert str(e.value).endswith("(every other rank had already returned: a collective this rank entered alone, "
                                 "e.g. code that takes another path on some ranks)")


STOPPED_WHILE_STARTING = """
import os, signal
from multiprocessing import Pipe
from partrain import _process, pool

original = _process.watch_parent  # what every child runs first calls it (child_started)

def terminated_while_starting(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # the caller stops it before it has taken a job
    return original(*args, **kwargs)

_process.watch_parent = terminated_while_starting
ours, theirs = Pipe()
pool._process_main(theirs, True)
print("returned quietly")
"""


def test_a_worker_stopped_while_it_starts_exits_quietly():
    """Ctrl-C right after a launch: the launcher's SIGTERM can reach a worker before it has set
    up (here: while it starts watching its parent). It must end as an idle one does, without a
    traceback of its own beside the launcher's one line (a CI run once showed one)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", STOPPED_WHILE_STARTING], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout.strip(), done.stderr.strip()) == (0, "returned quietly", "")
