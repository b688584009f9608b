"""Suite-wide fixtures.

Worker processes are started once per test session and reused: the whole suite runs
inside one `partrain.WorkerPool`, so each `launch` / `fit` gets a fresh process
group on a fresh store but not a fresh interpreter (importing torch in a new process
costs seconds; a suite with a hundred launches would spend minutes on it; one pool
per module cost about 45 s of the suite's 8 minutes). Under pytest-xdist (``make test``
runs two pytest workers) each worker has its own pool. The pool starts its processes
at the first launch only, and replaces a process whose job failed. A test that needs brand-new processes marks itself
``@pytest.mark.fresh_processes``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator

import pytest

import partrain
from partrain.pool import no_pool

POOL_PROCESSES = 4  # 2 workers + 2 parameter servers: the largest job of the suite

#: The slowest modules, slowest first (seconds of one worker on the 2-core CI host, summed over
#: the module's tests; `--durations=0`, 28 Nov, before partrain's processes came from a fork
#: server: most are shorter now, their order roughly the same). `make test` hands whole modules
#: to its two pytest workers as each gets free (`--dist loadscope`), in collection order; this hook moves these to
#: the front, so the long ones start at once and the short ones fill in at the end, instead of a
#: 40-90 s module starting last on one worker while the other idles. A scheduling hint only: any
#: order runs the same tests.
SLOWEST_FIRST = (
    "rl/test_cartpole.py",  # 42 s, 88 s when its first run does not solve
    "test_signals.py",  # 132 s
    "bench/test_smoke.py",  # 104 s
    "strategies/test_parameter_server.py",  # 57 s
    "test_pool.py",  # 48 s
    "train/test_tasks.py",  # 47 s
    "test_ray.py",  # 46 s
    "test_elastic.py",  # 43 s
    # CPU-heavy (a broker and its clients; transformers on 2 workers): after the first modules, so
    # that in the usual schedule they start after the CartPole run, whose learning suffers on an
    # oversubscribed machine (placed third, the MQTT benchmark test ran beside it and both of its
    # runs fell short of 475)
    "bench/test_stream_mqtt.py",  # 40 s (bench stream --quick with a real broker)
    "train/test_language_models.py",  # 27 s
    "serve/test_loadtest_processes.py",  # 40 s
    "strategies/test_pipeline.py",  # 35 s
    "bench/test_lm.py",  # 25 s
    "strategies/test_pipeline_transformers.py",  # 22 s
    "compare/test_compare_gpt.py",  # 20 s
    "train/test_feeding.py",  # 35 s
    "nn/test_freeze.py",  # 30 s
    "test_clusters.py",  # 29 s
    "train/test_mid_epoch.py",  # 25 s
    "stream/test_cli.py",  # 21 s
    "serve/test_loadtest.py",  # 20 s
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fresh_processes: run launches of this test in new processes, no pool")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules of `SLOWEST_FIRST` first, in its order; every other test after them, in its own order."""
    rank = {f"tests/{name}": i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session", autouse=True)
def suite_pool() -> Iterator[partrain.WorkerPool]:
    """The session's pool (every launch runs on it; request it to inspect it)."""
    with partrain.WorkerPool(POOL_PROCESSES) as pool:
        yield pool


@pytest.fixture(autouse=True)
def _fresh_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("fresh_processes") is None:
        yield
        return
    with no_pool():
        yield


#: seconds before pytest-timeout fails a test at which its processes' stacks are written
STACKS_BEFORE_TIMEOUT = 30


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its ``SigCgt`` mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def write_child_stacks(reason: str) -> None:
    """Every child of this process that dumps its stacks on SIGUSR1 (partrain's do) writes them
    to its stderr, which the test's captured output shows: where a job that hangs is stuck."""
    pids = [p.pid for p in multiprocessing.active_children() if p.pid is not None]
    dumping = [pid for pid in pids if _catches(pid, signal.SIGUSR1)]
    print(f"\n{reason}: the stacks of processes {dumping} follow", file=sys.stderr, flush=True)
    for pid in dumping:
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            pass


@pytest.fixture(autouse=True)
def _stacks_before_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that runs close to its timeout has its processes' stacks written first: a hang in a
    worker process (the timeout shows only this process's stack) can then be read off the report."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)
    if limit <= STACKS_BEFORE_TIMEOUT or not hasattr(signal, "SIGUSR1"):
        yield
        return
    timer = threading.Timer(limit - STACKS_BEFORE_TIMEOUT, write_child_stacks,
                            args=(f"{request.node.nodeid} still runs {STACKS_BEFORE_TIMEOUT} s before its timeout",))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
