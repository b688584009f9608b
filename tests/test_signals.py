"""A signal stops every process partrain started: no orphan trains on, no temporary directory stays.

Why this exists: SIGTERM used to end ``partrain train`` on the spot (status 143) while
its two workers, never told, trained to the end as orphans and kept rewriting
``metrics.csv`` and ``checkpoint.pt``; the launcher's temporary directory stayed.

Each test starts a real command in a session of its own (so that every process it
starts, and every orphan, can be found by its session id in /proc), waits until the
workers are provably working (a file they write, the store they meet through), sends
the signal and checks: the exit status, the one line on stderr, that no process of the
session is alive after a bounded wait, that the temporary directory is gone and that
the run's files have stopped changing. Start reading at `test_sigterm_stops_train`.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from partrain.cli import main

from .waiting import wait_until

REPO = Path(__file__).resolve().parents[1]
START = 180.0  # seconds for a command to get its workers going on a loaded 2-core machine
pytestmark = pytest.mark.timeout(300)


# ----- processes, from /proc ------------------------------------------------------------------

def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return fields[0], int(fields[1]), int(fields[3])


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # a zombie has finished; only its exit code is left


def session_members(sid: int) -> list[int]:
    """Live processes of session ``sid``: the command, its children, and any orphan of theirs."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[2] == sid and stat[0] != "Z":
                found.append(int(entry))
    return found


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None and stat[1] == pid and stat[0] != "Z":
                found.append(int(entry))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def started_children(pid: int) -> list[int]:
    """Live processes ``pid`` started through multiprocessing (not its resource tracker): spawned
    ones (its children running ``spawn_main``) and forked ones (the children of its fork server)."""
    found = []
    for child in _children(pid):
        cmdline = _cmdline(child)
        if b"spawn_main" in cmdline:
            found.append(child)
        elif b"multiprocessing.forkserver" in cmdline:
            found.extend(_children(child))
    return found


# ----- a command in its own session -------------------------------------------------------------

class Command:
    """``python -m partrain ARGS`` in a new session, its output read by threads (never blocks)."""

    def __init__(self, args: list[str], block_sigint: bool = False) -> None:
        # a short TMPDIR: under pytest's longer ones the fork server's socket path does not fit and
        # the command falls back to spawn (`partrain._process.process_context`); here it runs as users run it
        self.tmpdir = Path(tempfile.mkdtemp(prefix="sig-"))
        env = {**os.environ, "TMPDIR": str(self.tmpdir), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        # block_sigint: the command inherits a mask that blocks SIGINT, as from a thread that
        # blocked it (Python's resource tracker does while it starts its process)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if block_sigint else None
        # SIGINT at its default in the command, as a terminal starts it: a test run started in
        # the background (`make test &`) ignores SIGINT, and an ignored signal stays ignored in
        # every process started from there (partrain keeps it so: a background job's choice); a
        # handler, unlike SIG_IGN, is reset to the default by exec
        old_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:  # -X faulthandler: a command that hangs is sent SIGABRT (`finish`) and prints its stacks
            self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "partrain", *args], cwd=REPO,
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True)
        finally:
            signal.signal(signal.SIGINT, old_handler)
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(s, into), daemon=True)
                         for s, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    @property
    def sid(self) -> int:
        return self.proc.pid  # start_new_session: the command leads its own session

    def wait_for(self, condition, what: str) -> None:
        wait_until(lambda: condition() or self.proc.poll() is not None, what, timeout=START, interval=0.05)
        assert self.proc.poll() is None, f"exited with {self.proc.returncode} before {what}:\n{self.output()}"

    def finish(self, timeout: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            masks = _signal_masks(self.proc.pid)  # pending, blocked, ignored, caught: where did it go?
            self.proc.send_signal(signal.SIGABRT)  # faulthandler writes the stacks to stderr, then it dies
            self.proc.wait(30)
            for t in self._readers:
                t.join(10)
            raise AssertionError(f"still running {timeout:g} s after the signal; its signal masks: {masks}; "
                                 f"its stacks:\n{self.output()}") from None
        for t in self._readers:
            t.join(10)
        return code

    def stderr_lines(self) -> list[str]:
        return [line.rstrip("\n") for line in self.err if line.strip()]

    def output(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def leftover_dirs(self) -> list[str]:
        return sorted(p.name for p in self.tmpdir.iterdir() if p.name.startswith("partrain-"))

    def rendezvous(self) -> list[str]:
        """The store files of `launch`'s temporary directories: present once workers met there."""
        return glob.glob(str(self.tmpdir / "partrain-*" / "rendezvous"))

    def close(self) -> None:
        """Whatever happened in the test: nothing of the session survives it."""
        for pid in session_members(self.sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _signal_masks(pid: int) -> str:
    """The process's and each thread's signal sets from /proc, as signal names."""
    known = {s.value: s.name for s in signal.Signals}  # real-time signals beyond SIGRTMIN have no name

    def names(hexmask: str) -> list[str]:
        bits = int(hexmask, 16)
        return [known.get(n, str(n)) for n in range(1, 65) if bits >> (n - 1) & 1]
    parts = []
    try:
        for task in sorted(os.listdir(f"/proc/{pid}/task")):
            for line in Path(f"/proc/{pid}/task/{task}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("SigPnd", "ShdPnd", "SigBlk", "SigIgn") and (task == str(pid) or key != "ShdPnd"):
                    parts.append(f"{task} {key}={names(value.strip())}")
    except OSError as exc:
        parts.append(f"unreadable: {exc}")
    return "; ".join(parts)


def no_survivors(cmd: Command, timeout: float = 30.0) -> None:
    try:
        wait_until(lambda: not session_members(cmd.sid), "every process of the session to exit", timeout=timeout,
                   interval=0.05)
    except AssertionError as exc:  # which processes, doing what: their Python stacks (faulthandler)
        survivors = [_describe(pid) for pid in session_members(cmd.sid)]
        for pid in session_members(cmd.sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not session_members(cmd.sid), "the stacks", timeout=10, interval=0.05)
        raise AssertionError(f"{exc}; survivors:\n" + "\n".join(survivors) + f"\noutput:\n{cmd.output()}") from None


def _describe(pid: int) -> str:
    """A live process for a failure message: its state, parent, command line and kernel wait channel."""
    def read(name: str) -> str:
        try:
            return Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return "?"
    return f"pid {pid} stat {_stat(pid)} wchan {read('wchan')} cmdline {read('cmdline')}"


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Name -> (modification time, size) of the files of a run (none before it wrote any)."""
    if not directory.exists():
        return {}
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in sorted(directory.iterdir())}


def train_args(out: Path) -> list[str]:
    # far more epochs than the test lasts: only a signal ends this run; a checkpoint every
    # 3 steps: the workers are writing files all the time
    return ["train", "--dataset", "digits", "--workers", "2", "--threads", "1", "--epochs", "10000", "--quiet",
            "--checkpoint-every", "3", "--out", str(out)]


# ----- train ------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGINT to the group (Ctrl-C)"])
def test_sigterm_stops_train(tmp_path: Path, how: str) -> None:
    out = tmp_path / "run"
    # Ctrl-C: started with SIGINT blocked in the inherited mask, which the command must undo
    # (before it did, the launcher waited on its workers forever with SIGINT pending)
    cmd = Command(train_args(out), block_sigint=how.startswith("SIGINT"))
    try:
        if how.startswith("SIGTERM"):  # mid-training: the workers write files, the case of the orphans
            cmd.wait_for(lambda: (out / "checkpoint.pt").exists(), "the first checkpoint")
        else:  # as soon as the workers run their job
            cmd.wait_for(cmd.rendezvous, "the workers to meet")
        workers = started_children(cmd.proc.pid)
        assert len(workers) == 2, workers
        # the default start method: forks of the command's fork server (`process_context`)
        assert all(b"multiprocessing.forkserver" in _cmdline(_stat(w)[1]) for w in workers), workers
        if how.startswith("SIGTERM"):
            sig = signal.SIGTERM
            os.kill(cmd.proc.pid, sig)  # the launcher alone: it must stop the workers itself
        else:
            sig = signal.SIGINT
            os.killpg(cmd.proc.pid, sig)  # what a terminal's Ctrl-C does: every process of the group
        code = cmd.finish()
        at_exit = snapshot(out)
        assert code == 128 + sig, cmd.output()
        assert cmd.stderr_lines() == [f"partrain train: stopped by {sig.name}; 2 worker processes stopped"]
        assert not any(_alive(pid) for pid in workers)  # stopped before the launcher exited
        no_survivors(cmd)
        assert cmd.leftover_dirs() == []
        assert snapshot(out) == at_exit  # nobody writes any more
        assert not [p for p in at_exit if p.endswith(".tmp")]  # no half-written checkpoint
    finally:
        cmd.close()


def test_workers_stop_when_the_launcher_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves the launcher no chance to clean up: the workers notice it died and stop."""
    out = tmp_path / "run"
    cmd = Command(train_args(out))
    try:
        cmd.wait_for(cmd.rendezvous, "the workers to meet")
        os.kill(cmd.proc.pid, signal.SIGKILL)
        assert cmd.finish() == -signal.SIGKILL
        # the store's file is there once one worker runs; the other may still be importing
        # torch, and it can notice the launcher died only when its own code runs: under a
        # loaded CI machine that took more than 30 s (seen once); the first worker, blocked
        # in the group's rendezvous, leaves after its 5 s grace
        no_survivors(cmd, timeout=START)
        at_end = snapshot(out)
        assert cmd.leftover_dirs() == []  # the workers removed the launcher's rendezvous directory
        assert snapshot(out) == at_end
    finally:
        cmd.close()


def _fork_server_up(cmd: Command) -> bool:
    return any(b"multiprocessing.forkserver" in _cmdline(pid) for pid in _children(cmd.proc.pid))


#: the moments a scheduler's ``kill -9`` or the OOM killer can land, each a condition on the run
KILL_MOMENTS = {
    "importing": None,  # at once: the launcher is still importing torch
    "fork server importing": _fork_server_up,  # the server imports torch and partrain (seconds)
    "first worker forked": lambda cmd: len(started_children(cmd.proc.pid)) >= 1,
    "workers met": lambda cmd: cmd.rendezvous(),
    "training": None,  # set below: the first checkpoint is written
}


#: an open bug, not a pass: at this moment a forked worker now and then outlives its SIGKILLed launcher
#: (3 of 5 suite runs in stop 60, under load; never alone): its parent-death watch waits on a
#: sentinel that does not end (nor, tried, the parent's pidfd) while its main thread sleeps in the
#: rendezvous until the store's timeout. It is reported as xfail/xpass until found (issue 55).
SURVIVOR = pytest.mark.xfail(reason="a forked worker sometimes outlives its killed launcher (open, issue 55)",
                             strict=False)


@pytest.mark.parametrize("moment,attempt", [pytest.param(m, i, marks=[SURVIVOR] if m == "first worker forked" else [])
                                            for i in range(4) for m in KILL_MOMENTS],
                         ids=[f"{m}-{i}" for i in range(4) for m in KILL_MOMENTS])
def test_a_launcher_killed_at_any_moment_leaves_no_process(tmp_path: Path, moment: str, attempt: int) -> None:
    """Issue 55, item 3: SIGKILL to ``partrain train --workers 2``, twenty times over five moments of
    its start and its training; after each, every process of its session ends (the launcher's fork
    server too, mid-import or not: it watches its starter)."""
    out = tmp_path / "run"
    cmd = Command(train_args(out))
    try:
        condition = KILL_MOMENTS[moment] or ((lambda c: (out / "checkpoint.pt").exists()) if moment == "training"
                                             else None)
        if condition is not None:
            cmd.wait_for(lambda: condition(cmd), moment)
        os.kill(cmd.proc.pid, signal.SIGKILL)
        assert cmd.finish() == -signal.SIGKILL
        no_survivors(cmd, timeout=START)
    finally:
        cmd.close()


# ----- serve (`partrain population` stops by the path `partrain train` takes: `cli.main` stops
# the workers of its `launch`; a test of its own cost 13 s of CI's 8 minutes) ---------------------

def tiny_model() -> torch.nn.Module:
    """Served by the replica tests (module-level: replicas import it by name)."""
    return torch.nn.Linear(3, 2)


SERVE = ["serve", "tiny=tests.test_signals:tiny_model", "--replicas", "2", "--threads", "1", "--port", "0"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_replicas_stop_with_the_server(sig: signal.Signals) -> None:
    """SIGTERM: a graceful stop (status 0, as for one process) saying what it stopped; SIGKILL of
    the parent: the replicas notice and shut down by themselves."""
    cmd = Command(SERVE)
    try:
        cmd.wait_for(lambda: any("serving" in line for line in cmd.out), "the server's announcement")
        replicas = started_children(cmd.proc.pid)
        assert len(replicas) == 2, replicas
        os.kill(cmd.proc.pid, sig)
        code = cmd.finish()
        if sig == signal.SIGTERM:
            assert code == 0, cmd.output()
            assert cmd.stderr_lines() == ["partrain serve: stopped by SIGTERM; 2 replica processes stopped"]
            assert not any(_alive(pid) for pid in replicas)
        else:
            assert code == -signal.SIGKILL
        no_survivors(cmd)
    finally:
        cmd.close()


def _requests_served(url: str) -> float:
    """The server's inference-request count, from its ``/metrics``."""
    base = url.split("/v2/", 1)[0]  # the announced URL is the model's infer endpoint
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("partrain_inference_requests_total{"))


def test_a_load_test_over_client_processes_stops_with_ctrl_c() -> None:
    """``partrain loadtest --processes 2``: Ctrl-C (SIGINT to the whole group) mid-run stops the
    command and both client processes, with one line and status 130."""
    server = Command(["serve", "tiny=tests.test_signals:tiny_model", "--threads", "1", "--port", "0"])
    load = None
    try:
        server.wait_for(lambda: any("serving" in line for line in server.out), "the server's announcement")
        url = next(word for line in server.out for word in line.split() if word.startswith("http://"))
        load = Command(["loadtest", url, "--model", "tiny", "-c", "4", "-d", "600", "--processes", "2"])
        # a request reached the server: both clients are past their start barrier, so both starts
        # have returned in the command (a fork server's child ignores SIGINT from its fork on, while
        # the command may still be inside its start: a Ctrl-C there found one process to name)
        load.wait_for(lambda: _requests_served(url) > 0, "the clients' first request")
        assert len(started_children(load.proc.pid)) == 2
        os.killpg(load.proc.pid, signal.SIGINT)
        assert load.finish() == 130, load.output()
        assert load.stderr_lines() == ["partrain loadtest: stopped by SIGINT; 2 load-generator processes stopped"]
        no_survivors(load)
    finally:
        if load is not None:
            load.close()
        server.close()


# ----- library use: launch from someone's program ------------------------------------------------

LIBRARY_SCRIPT = textwrap.dedent('''
    import multiprocessing, os, signal, tempfile
    import partrain
    from partrain.errors import Interrupted

    def work(strategy, launcher):
        if strategy.rank == 0:  # (the launcher, not os.getppid(): a fork server's child has the server as parent)
            os.kill(launcher, signal.SIGTERM)  # the launcher is told to stop while we work
        while True:
            strategy.barrier()

    def run(pool):
        before = signal.getsignal(signal.SIGTERM)
        try:
            partrain.launch(work, os.getpid(), workers=2, timeout=60, pool=pool)
        except KeyboardInterrupt as exc:
            print("caught", type(exc).__name__, isinstance(exc, Interrupted) and exc.signum)
        print("handler restored", signal.getsignal(signal.SIGTERM) == before)
        print("children", len(multiprocessing.active_children()) if pool is None else repr(pool))
        print("temp dirs", [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("partrain-")])

    if __name__ == "__main__":
        run(None)
        run(partrain.WorkerPool(2))
''')


def test_library_callers_get_a_keyboard_interrupt_and_no_children(tmp_path: Path) -> None:
    """From Python, SIGTERM during `launch` is a KeyboardInterrupt the caller can catch, raised
    after the workers were stopped and the temporary directory removed; the caller's own
    signal handling is back when `launch` returns. Processes of its own, then a WorkerPool's."""
    script = tmp_path / "script.py"
    script.write_text(LIBRARY_SCRIPT)
    tmpdir = Path(tempfile.mkdtemp(prefix="sig-"))  # short: see `Command`
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
        leftover = [d for d in os.listdir(tmpdir) if d.startswith(("partrain-", "pymp-"))]
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    assert leftover == []  # multiprocessing's directory (the fork server's socket) went at exit too
    assert proc.stdout.splitlines() == [
        "caught Interrupted 15", "handler restored True", "children 0", "temp dirs []",
        "caught Interrupted 15", "handler restored True", "children WorkerPool(processes=2, alive=0)",
        "temp dirs []",
    ]


# ----- the command's handling, in this process ---------------------------------------------------

def test_main_turns_a_signal_into_one_line_and_puts_the_handlers_back(monkeypatch, capsys) -> None:
    import partrain.train.cli as train_cli

    def signalled(args) -> int:
        os.kill(os.getpid(), signal.SIGTERM)  # raises Interrupted here, at the next bytecode
        raise AssertionError("SIGTERM did not interrupt the command")

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(train_cli, "run", signalled)
    # this command started no process (the suite's worker pool is not its own: leave it alone)
    monkeypatch.setattr("partrain.cli.multiprocessing.active_children", lambda: [])
    assert main(["train"]) == 143
    assert capsys.readouterr().err.splitlines() == ["partrain train: stopped by SIGTERM"]
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_that_lands_in_a_callback_still_stops_the_command(monkeypatch, capsys) -> None:
    """Python runs the handler at the next bytecode, which may be inside a weakref callback
    (importlib's module locks have one): the `Interrupted` raised there cannot propagate and
    used to be printed as "Exception ignored in ..." (seen once when SIGTERM hit the launcher
    during an import). It must stop the command all the same, with the one line only."""
    import weakref

    import partrain.train.cli as train_cli

    class Target:
        pass

    def signal_in_callback(ref) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the callback
        for _ in range(100):  # bytecodes for the handler to run on
            pass

    def signalled(args) -> int:
        target = Target()
        ref = weakref.ref(target, signal_in_callback)
        del target  # the callback runs now; its Interrupted is lost, and the signal sent again
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the signal, sent again, interrupts this loop
            pass
        raise AssertionError(f"SIGTERM was lost in the callback ({ref})")

    monkeypatch.setattr(train_cli, "run", signalled)
    monkeypatch.setattr("partrain.cli.multiprocessing.active_children", lambda: [])
    hook = sys.unraisablehook
    assert main(["train"]) == 143
    assert capsys.readouterr().err.splitlines() == ["partrain train: stopped by SIGTERM"]
    assert sys.unraisablehook is hook


def test_after_a_signal_the_resource_sharers_tracebacks_are_not_shown() -> None:
    """A child stopped mid-way through receiving a shared tensor's file descriptor makes
    multiprocessing's resource-sharer thread print a traceback (seen once under SIGTERM to
    `partrain population`); once the command stops its children, that one is expected."""
    from partrain.cli import _quiet_resource_sharer

    seen = []
    hook = _quiet_resource_sharer(lambda *exc: seen.append(exc[1]))
    sharer = os.path.join(os.path.dirname(os.__file__), "multiprocessing", "resource_sharer.py")
    namespace: dict = {}
    exec(compile("def serve():\n    raise EOFError('child gone')\n", sharer, "exec"), namespace)
    for fn in (namespace["serve"], lambda: 1 / 0):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            hook(type(exc), exc, exc.__traceback__)
    assert [type(e) for e in seen] == [ZeroDivisionError]  # the sharer's is dropped, any other one shown


def test_the_first_child_starts_with_sigint_blocked_though_it_starts_the_resource_tracker(tmp_path: Path) -> None:
    """CPython's resource tracker, started by the first spawned child, unblocks SIGINT in the calling
    thread once it runs: `starting_processes` must still hand the child a blocked SIGINT (a Ctrl-C
    during the first worker's imports printed a traceback in CI). In a fresh interpreter, where no
    tracker runs yet; the child reports the mask it started with."""
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import signal

        def report(conn):
            conn.send(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    """))
    script = textwrap.dedent(f"""
        import multiprocessing as mp, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import probe
        from partrain._process import starting_processes
        ctx = mp.get_context("spawn")
        here, there = ctx.Pipe()
        with starting_processes():
            child = ctx.Process(target=probe.report, args=(there,))
            child.start()
        print("blocked" if here.recv() else "unblocked")
        child.join(60)
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["blocked"]
