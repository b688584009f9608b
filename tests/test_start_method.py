"""How partrain starts its local processes: a fork server on Linux, ``spawn`` on request.

A fork of the server is not a fresh interpreter: it has the server's environment and
working directory of when the server started. These tests check that a job's ranks
see the caller's of now under both start methods, that the method is the one asked
for (a fork server's child is the server's child, not the caller's), and that a bad
choice is one line.
"""

from __future__ import annotations

import multiprocessing.util
import os
import signal
import subprocess
import sys

import pytest

import partrain
from partrain._process import process_context
from partrain.errors import UsageError, WorkerError

from .test_signals import _alive, _stat

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is the default on Linux")


def where_am_i(strategy):
    return {"rank": strategy.rank, "parent": os.getppid(), "mark": os.environ.get("PARTRAIN_TEST_MARK"),
            "gone": os.environ.get("PARTRAIN_TEST_GONE"), "cwd": os.getcwd()}


@LINUX
def test_the_default_is_the_fork_server_on_linux(monkeypatch):
    monkeypatch.delenv("PARTRAIN_START_METHOD", raising=False)
    assert process_context().get_start_method() == "forkserver"


@pytest.mark.parametrize("method", ["spawn", " Spawn ", "forkserver"])
def test_partrain_start_method_chooses(monkeypatch, method):
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork server on this platform")
    monkeypatch.setenv("PARTRAIN_START_METHOD", method)
    assert process_context().get_start_method() == method.strip().lower()


@pytest.mark.parametrize("method", ["fork", "threads"])
def test_a_bad_start_method_is_one_line(monkeypatch, method):
    monkeypatch.setenv("PARTRAIN_START_METHOD", method)
    with pytest.raises(UsageError) as info:
        process_context()
    assert str(info.value).startswith("Expected PARTRAIN_START_METHOD to be one of ")
    assert str(info.value).endswith(f"Received: {method!r}")
    assert "\n" not in str(info.value)


@LINUX
def test_a_tmpdir_too_long_for_the_servers_socket_falls_back_to_spawn(monkeypatch):
    monkeypatch.delenv("PARTRAIN_START_METHOD", raising=False)
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: "/tmp/" + "d" * 90)  # 113 bytes with the socket's name
    assert process_context().get_start_method() == "spawn"
    monkeypatch.setattr(multiprocessing.util, "get_temp_dir", lambda: "/tmp/" + "d" * 84)  # 107
    assert process_context().get_start_method() == "forkserver"


@pytest.mark.timeout(120)
@pytest.mark.fresh_processes
@pytest.mark.parametrize("method", [pytest.param("forkserver", marks=LINUX), "spawn"])
def test_ranks_see_the_callers_environment_and_directory_of_now(monkeypatch, tmp_path, method):
    monkeypatch.setenv("PARTRAIN_START_METHOD", method)
    monkeypatch.setenv("PARTRAIN_TEST_GONE", "before")
    partrain.launch(where_am_i, workers=2, timeout=60)  # the fork server runs by now (if not before)
    monkeypatch.setenv("PARTRAIN_TEST_MARK", "after")
    monkeypatch.delenv("PARTRAIN_TEST_GONE")
    monkeypatch.chdir(tmp_path)
    seen = partrain.launch(where_am_i, workers=2, timeout=60)
    assert [s["rank"] for s in seen] == [0, 1]
    for s in seen:
        assert (s["mark"], s["gone"], s["cwd"]) == ("after", None, str(tmp_path))
        if method == "spawn":
            assert s["parent"] == os.getpid()
        else:  # forked by the server, which this process started
            assert s["parent"] != os.getpid() and _stat(s["parent"])[1] == os.getpid()


def kill_the_fork_server(strategy, directory):
    with open(os.path.join(directory, f"rank{strategy.rank}"), "w") as f:
        f.write(str(os.getpid()))
    strategy.barrier()
    if strategy.rank == 0:
        os.kill(os.getppid(), signal.SIGKILL)  # the fork server: the parent of a forked rank
    while True:  # until stopped (SIGTERM raises in this process)
        signal.pause()


@LINUX
@pytest.mark.timeout(120)
@pytest.mark.fresh_processes
def test_a_dead_fork_server_fails_the_job_saying_so_and_its_ranks_are_stopped(monkeypatch, tmp_path):
    monkeypatch.setenv("PARTRAIN_START_METHOD", "forkserver")
    with pytest.raises(WorkerError) as info:
        partrain.launch(kill_the_fork_server, str(tmp_path), workers=2, timeout=60)
    assert "or the fork server it came from died" in str(info.value)
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
    assert not [pid for pid in pids if _alive(pid)]  # stopped by pid: they were the server's children
    assert partrain.launch(where_am_i, workers=2, timeout=60)[1]["rank"] == 1  # a new server starts them



PRELOAD_CHECK = """
import sys
import torch
import torch.cuda
asked = []
for name in ("is_available", "device_count", "init", "current_device", "get_device_properties"):
    real = getattr(torch.cuda, name)
    setattr(torch.cuda, name, lambda *a, _name=name, _real=real, **k: asked.append(_name) or _real(*a, **k))
import partrain._forkserver
import torch.utils._triton as triton_utils
print(asked, torch.cuda.is_initialized(), triton_utils.has_triton.cache_info().misses,
      "PYTORCH_NVML_BASED_CUDA_CHECK" in __import__("os").environ)
"""


def test_the_fork_servers_imports_ask_for_no_device():
    # a process forked after CUDA's initialisation cannot use CUDA: the server must never ask
    # (has_triton() asks torch.cuda.is_available() where triton is installed)
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    proc = subprocess.run([sys.executable, "-c", PRELOAD_CHECK], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "False", "0", "False"]


EARLY = """
import os
from partrain._process import start_server_early
start_server_early()
servers = []
for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
    except OSError:
        continue
    if int(stat[1]) == os.getpid() and b"multiprocessing.forkserver" in cmdline:
        servers.append(entry)
print(len(servers))
"""


@LINUX
@pytest.mark.parametrize(("method", "servers"), [("forkserver", "1"), ("spawn", "0")])
def test_the_server_can_start_before_the_first_process(method, servers):
    # fit and compare start it first, so that it imports torch while they load data and time a step
    env = {**os.environ, "PARTRAIN_START_METHOD": method}
    proc = subprocess.run([sys.executable, "-c", EARLY], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [servers]


STARTER_KILLED_WHILE_THE_SERVER_IMPORTS = """
import multiprocessing, os, sys, threading
from multiprocessing import forkserver
ctx = multiprocessing.get_context("forkserver")
ctx.set_forkserver_preload(["partrain._forkserver", "import_forever"])  # the second never ends
forkserver.ensure_running()
print(forkserver._forkserver._forkserver_pid, flush=True)
threading.Event().wait()  # until killed
"""


@LINUX
def test_a_fork_server_ends_with_the_process_that_started_it_even_mid_import(tmp_path):
    """SIGKILL or the OOM killer on a launcher: its fork server must not live on. multiprocessing's
    server only notices once its imports are done (seconds of torch; here never) and once every
    child it forked has ended; partrain's preload watches the starter itself (issue 55, item 3)."""
    from tests.waiting import wait_until

    marker = tmp_path / "importing"
    (tmp_path / "import_forever.py").write_text(f"import pathlib, threading\npathlib.Path({str(marker)!r}).touch()\n"
                                                "threading.Event().wait()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    starter = subprocess.Popen([sys.executable, "-c", STARTER_KILLED_WHILE_THE_SERVER_IMPORTS], env=env,
                               stdout=subprocess.PIPE, text=True)
    server = None
    try:
        assert starter.stdout is not None
        server = int(starter.stdout.readline())
        wait_until(marker.exists, "the server's import of import_forever", timeout=120)
        starter.kill()
        starter.wait(30)
        wait_until(lambda: not _alive(server), "the fork server's end after its starter's", timeout=60)
    finally:
        starter.kill()
        if server is not None and _alive(server):
            os.kill(server, signal.SIGKILL)

