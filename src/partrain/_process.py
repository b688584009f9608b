"""Inside one process of a job, and the life of the processes partrain starts.

`run_in_process` is what every process of a job runs, whoever started it: a
process `partrain.launch` spawned, a `WorkerPool` process, torchrun's worker,
or the caller itself in a one-process run.

The rest is the one way partrain starts and stops local processes (pool workers,
serving replicas): `starting_processes` around ``Process.start()`` (a Ctrl-C
aimed at the launcher does not reach a child still importing torch),
`watch_parent` in the child (it stops when the process that started it dies, even
by SIGKILL: no orphan keeps training and writing files), `stop_processes` to stop
them (terminate, a bounded wait, kill), and `check_not_bootstrapping` for the
script that calls `fit` at import time.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist

from . import comm
from .env import DistEnv, external_job
from .errors import UsageError
from .host_exchange import pid_alive
from .strategies.base import WORKER, Strategy

#: exit status of a spawned process whose import of the caller's script called `launch` again
MAIN_GUARD_EXIT = 86
#: exit status of a process that stopped because the process that started it died
ORPHAN_EXIT = 87


def run_in_process(fn: Callable[..., Any], args: tuple, kwargs: dict, strat: Strategy, env: DistEnv,
                   timeout: float, threads: int | None, store: Any) -> Any:
    """Threads, process group, strategy, then the role's body; the group goes when it returns."""
    if env.world_size > 1:
        tune_allocator()
    if threads is not None:
        torch.set_num_threads(threads)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    own_group = False
    if env.world_size > 1:
        if dist.is_initialized():  # the launcher made the group (Ray Train): use it, never a second one
            check_existing_group(env)
        if store is None:  # torchrun, srun, PyTorchJob, Ray: the job's store (join_store)
            store = join_store(env, timeout)
        if not dist.is_initialized():
            comm.init_process_group(env.backend, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout)
            own_group = True
            if env.backend == "gloo":
                # gloo connects every pair when the group is made; a rank whose body needs no
                # collective could return and close its sockets while a peer still connects to
                # it ("Gloo connectFullMesh failed" under load). Past this barrier every rank's
                # mesh is up. (NCCL connects at the first collective: nothing to wait for.)
                dist.barrier()
    try:
        strat.setup(env, store=store, timeout=timeout)
        role = strat.role
        if role == WORKER:
            return fn(strat, *args, **kwargs)
        return strat.run_role(role)
    finally:
        try:
            strat.close()
        finally:
            if own_group and dist.is_initialized():
                # the job's garbage first (a DDP Reducer in a reference cycle holds the group): freed
                # later by a collection at any moment, the group's destructor joins gloo's threads while
                # holding the GIL that a thread freeing a finished all-gather's tensors waits for - a
                # deadlock (CI: a worker stuck in pickling its result, ~ProcessGroupGloo under gc)
                gc.collect()
                dist.destroy_process_group()
                comm.forget_groups()


def check_existing_group(env: DistEnv) -> None:
    """One line when the process group the launcher made is not the job the variables describe."""
    have = (dist.get_rank(), dist.get_world_size())
    if have != (env.rank, env.world_size):
        raise UsageError(f"Expected the existing process group to be rank {env.rank} of {env.world_size} "
                         f"(RANK, WORLD_SIZE). Received: rank {have[0]} of {have[1]}")


def join_store(env: DistEnv, timeout: float) -> dist.Store:
    """The job's store when another launcher started us: torchrun, srun, a PyTorchJob, Ray.

    Where it is comes from `external_job` (MASTER_ADDR/MASTER_PORT, or under srun the
    first host of the node list and a port derived from the job id). Under torchrun's
    elastic agent (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent hosts the store and
    every worker is a client; otherwise rank 0 hosts it, unless a process group already
    exists (Ray Train made one: its store is up, join it). Keys are prefixed by
    ``TORCHELASTIC_RESTART_COUNT``: the agent's store outlives a restart, and a new
    attempt must not meet the keys of the last one (re-forming gloo fails on them).
    """
    job = external_job()
    addr = job.master_addr if job is not None else None
    port = job.master_port if job is not None else None
    if addr is None or port is None:
        hint = (" (Ray Train: keep TorchConfig(init_method='env'), its default)"
                if dist.is_initialized() else "")
        raise UsageError(f"Expected MASTER_ADDR and a numeric MASTER_PORT for a job of {env.world_size} "
                         f"processes{hint}. Received: MASTER_ADDR={os.environ.get('MASTER_ADDR')!r}, "
                         f"MASTER_PORT={os.environ.get('MASTER_PORT')!r}")
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_host = env.rank == 0 and not agent_hosts and not dist.is_initialized()
    try:
        store = dist.TCPStore(addr, port, world_size=None, is_master=is_host,
                              timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:  # port taken, host unknown, no answer within the timeout
        role = "host" if is_host else "reach"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"Expected to {role} the job's store at {addr}:{port} "
                         f"({job.launcher if job else 'torchrun'}). Received: {first}") from None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"partrain/attempt{attempt}", store)


#: glibc's mmap threshold in the processes partrain tunes: blocks from 32 MiB are mapped and
#: unmapped (glibc's own largest dynamic threshold), smaller ones reused from the heap
MMAP_THRESHOLD = 32 * 1024 * 1024


def tune_allocator(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Keep freed tensor memory in glibc's heap instead of returning it to the OS.

    glibc serves large blocks with mmap and gives them back on free, so every training
    step page-faults its activations in afresh; with several processes per machine this
    cost 15-20% of a DDP step on CPU (bench core, raw DDP vs fit, same kernels). Raising
    the mmap and trim thresholds makes the heap reuse those blocks; blocks from
    ``mmap_threshold`` up are still mapped (a strategy whose processes hold a model too large
    for one, ``pipeline``, maps its parameter-sized blocks: see `Pipeline.setup`). Applied in
    worker processes partrain starts or joins; ``PARTRAIN_MALLOC_TUNING=0`` turns it off.
    """
    if os.environ.get("PARTRAIN_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, int(mmap_threshold)) and libc.mallopt(m_trim_threshold, 1 << 30)
        return bool(ok)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False


# ----- starting and stopping local processes ----------------------------------------------

#: the start methods PARTRAIN_START_METHOD may name (where the platform has them)
START_METHODS = ("forkserver", "spawn")
#: what the fork server imports before its first fork (`partrain._forkserver`)
FORKSERVER_PRELOAD = "partrain._forkserver"


def process_context() -> Any:
    """The `multiprocessing` context every local process partrain starts comes from.

    On Linux, ``forkserver``: the first start launches a server process that imports
    torch and partrain once (`partrain._forkserver`); each process after that is a
    fork of it, ready in milliseconds (the server runs no operator and touches no
    CUDA: forking after ``import torch`` is what DataLoader workers do). Under ``spawn`` every
    process is a new interpreter importing torch again: seconds of CPU each, which
    on a small machine the ranks already running pay for. Elsewhere (macOS, Windows)
    ``spawn``. ``PARTRAIN_START_METHOD=spawn`` (or ``forkserver``) chooses.

    What differs from ``spawn``, and how partrain covers it: a forked process gets
    the server's environment variables and file descriptors of when the server
    started, not the caller's of now. So a job carries the caller's environment and
    working directory (`partrain.pool.Job`); multiprocessing itself carries the working
    directory too, ``sys.path`` and ``sys.argv``, and the child imports the caller's
    main script as under ``spawn`` (the server does not: a script that calls `fit`
    at import time gets its one line, not a dead server). Output written to file
    descriptors 1 and 2 goes where the caller's went when the server started.
    """
    method = os.environ.get("PARTRAIN_START_METHOD", "").strip().lower()
    available = multiprocessing.get_all_start_methods()
    if method:
        if method not in START_METHODS or method not in available:
            raise UsageError(f"Expected PARTRAIN_START_METHOD to be one of "
                             f"{', '.join(m for m in START_METHODS if m in available)}. Received: {method!r}")
    else:
        linux = sys.platform.startswith("linux") and "forkserver" in available
        method = "forkserver" if linux and _forkserver_can_listen() else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([FORKSERVER_PRELOAD])  # not "__main__": see above
    return ctx


def start_server_early() -> None:
    """Start the fork server now, where processes come from one (`process_context`).

    For a caller that will start processes after work of its own (loading data, checking
    the model, timing a step): the server imports torch meanwhile, on another core,
    instead of after that work, at the first ``Process.start()``. Cheap when the server
    runs already; a server that cannot start is reported by that first start.
    """
    if process_context().get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    with starting_processes(), contextlib.suppress(OSError):
        forkserver.ensure_running()


#: the longest path of a Unix socket on Linux (``sun_path``, less its terminating NUL)
_UNIX_PATH_MAX = 107


def _forkserver_can_listen() -> bool:
    """Whether the fork server's socket path fits: it is ``listener-XXXXXXXX`` in multiprocessing's
    temporary directory (under TMPDIR, fixed for the life of this process), and a long TMPDIR
    makes binding it fail ("AF_UNIX path too long"); ``spawn`` needs no socket."""
    from multiprocessing import util

    return len(os.path.join(util.get_temp_dir(), "listener-12345678")) <= _UNIX_PATH_MAX


@contextlib.contextmanager
def starting_processes() -> Iterator[None]:
    """Around ``Process.start()``: the child starts with SIGINT blocked.

    Ctrl-C in a terminal reaches every process of the foreground group; a child still
    importing torch would die of it with a traceback of its own. The blocked mask is
    inherited through fork and exec; the child ignores SIGINT and unblocks it once it
    runs (`partrain._signals.install_in_worker` then `unblock_interrupts`), which drops
    one pending. The calling thread only: a SIGINT meanwhile goes to another thread of
    this process and is handled as usual.
    """
    with _blocked({signal.SIGINT}) as old:
        if old is not None:
            _start_resource_tracker(old | {signal.SIGINT})
        yield


@contextlib.contextmanager
def _blocked(signals: set[int]) -> Iterator[set[int] | None]:
    """``signals`` blocked in the calling thread for the block (delivered after it); yields the mask
    before, or None where threads have no signal mask (Windows: nothing is blocked)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield None
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield old
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _start_resource_tracker(mask: Iterable[int]) -> None:
    """multiprocessing's resource tracker, started now if it is not running, then ``mask`` again.

    A spawned child gets the tracker's descriptor, so the first ``Process.start()`` starts
    the tracker, and CPython's ``resource_tracker.ensure_running`` unblocks SIGINT and
    SIGTERM in the calling thread once it has: the first child then started with SIGINT
    unblocked, and a Ctrl-C during its imports printed a traceback of its own (seen in CI).
    """
    from multiprocessing import resource_tracker

    try:
        resource_tracker.ensure_running()
    except OSError:
        pass  # `Process.start()` will try again and report it
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held (blocked) in the calling thread for the block, delivered after it.

    For clean-up a signal must not cut in two: multiprocessing unlinks a semaphore, then tells
    its resource tracker, in the object's finalizer; a signal handler that raises between the
    two leaves the tracker to warn, at exit, of a "leaked semaphore" it then fails to unlink
    (two warnings on the stderr of a command that had stopped with its one line).
    """
    with _blocked({signal.SIGINT, signal.SIGTERM}):
        yield


def unblock_interrupts() -> None:
    """In the child, once SIGINT is ignored: take it out of the mask `starting_processes` set."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def watch_parent(grace: float, on_death: Callable[[], None] | None = None) -> bool:
    """In a process `multiprocessing` started: stop when the parent dies, however it dies.

    A thread waits on the parent's sentinel (a pipe the parent holds open while it
    lives: no polling). When it ends: ``on_death()`` (e.g. remove the job's temporary
    directory, which the parent can no longer do), SIGTERM to this process's main
    thread (its handler unwinds the job: ``finally`` blocks run), and after ``grace``
    seconds, if the main thread is stuck in a native call, exit at once. Returns False
    where there is no parent to watch (a process that was not started by multiprocessing).
    """
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False
    main_thread = threading.main_thread().ident
    sentinel = parent.sentinel
    if main_thread is None:  # not started: cannot happen in a running interpreter
        return False

    def watch() -> None:
        wait([sentinel])
        if on_death is not None:
            with contextlib.suppress(Exception):
                on_death()
        with contextlib.suppress(OSError, ValueError):
            signal.pthread_kill(main_thread, signal.SIGTERM)
        time.sleep(grace)  # the bound on the orderly exit, not a synchronisation
        os._exit(ORPHAN_EXIT)

    threading.Thread(target=watch, name="partrain-parent-watch", daemon=True).start()
    return True


# ----- the one way partrain's children start -----------------------------------------------------
#
# Every child partrain starts (a pool's or launch's ranks, serving replicas, serving stages,
# load-generator clients) is started by `start_child` in the parent and runs `child_started`
# first: the same start-up signal rule (SIGINT blocked from the start until the child ignores
# it) and the same parent-death rule (the child stops when its parent dies, however it dies).

def start_child(ctx: Any, target: Callable[..., Any], args: tuple = (), *, name: str,
                keep: Callable[[Any], None], daemon: bool = False) -> Any:
    """Create and start ``ctx.Process(target, args)`` (``ctx``: `process_context`) with SIGINT
    blocked until it runs (`starting_processes`: a Ctrl-C meanwhile is the parent's to handle,
    not a traceback from a child still importing). ``keep(process)`` records it before a signal
    held back meanwhile is raised, so the caller can always stop what it started. ``target``
    must call `child_started` first."""
    proc = ctx.Process(target=target, args=args, name=name, daemon=daemon)
    with starting_processes():
        proc.start()
        keep(proc)
    return proc


def child_started(*, sigterm_raises: bool = True, grace: float = 5.0,
                  on_death: Callable[[], None] | None = None) -> None:
    """The first call in every child partrain starts (`start_child`).

    SIGINT is ignored (Ctrl-C reaches the terminal's whole process group: the parent decides)
    and unblocked; with ``sigterm_raises`` SIGTERM raises `partrain.errors.Interrupted`, so the
    child's ``finally`` blocks run when its parent stops it (else SIGTERM keeps its handler: a
    server that installs its own, or the default). When the parent dies without stopping it
    (SIGKILL, the OOM killer), the child runs ``on_death``, gets SIGTERM and, ``grace`` seconds
    later, exits (`watch_parent`).
    """
    if sigterm_raises:
        from ._signals import install_in_worker

        install_in_worker()  # SIGTERM raises Interrupted; SIGINT ignored
    else:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    unblock_interrupts()
    watch_parent(grace, on_death)
    dump_stacks_on_signal()


#: the signal on which a process partrain started writes every thread's Python stack to stderr
DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)


def dump_stacks_on_signal() -> bool:
    """``kill -USR1 PID`` makes this process write every thread's Python stack to its stderr
    and go on (`faulthandler`): where a worker of a job that seems stuck is. Left alone when
    the process already handles SIGUSR1 (the user's code) or has no such signal (Windows)."""
    if DUMP_SIGNAL is None or signal.getsignal(DUMP_SIGNAL) not in (signal.SIG_DFL, None):
        return False
    import faulthandler

    try:
        faulthandler.register(DUMP_SIGNAL, all_threads=True)
    except (ValueError, RuntimeError, OSError, AttributeError):  # no usable stderr
        return False
    return True


def stop_processes(procs: Iterable[Any], grace: float = 0.0, kill_after: float = 5.0) -> list[Any]:
    """Let processes end within ``grace`` seconds, then terminate (SIGTERM), then kill.

    ``procs`` are `multiprocessing` processes. Every wait is bounded: at most
    ``grace + 2 * kill_after`` seconds in all. Returns the processes that were still
    running when this was called.
    """
    procs = [p for p in procs if p.pid is not None]  # never started: nothing to stop
    _stop_orphaned_forks(procs, kill_after)
    running = [p for p in procs if p.exitcode is None]
    deadline = time.monotonic() + grace
    for p in running:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    late = [p for p in running if p.exitcode is None]
    for p in late:
        with contextlib.suppress(OSError):
            p.terminate()
    deadline = time.monotonic() + kill_after
    for p in late:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in late:
        if p.exitcode is None:
            with contextlib.suppress(OSError):
                p.kill()
            p.join(timeout=kill_after)
    return running


#: the exit code multiprocessing gives a fork server's child once it cannot ask the server for it
SERVER_GONE_EXIT = 255


def forked(proc: Any) -> bool:
    """Whether ``proc`` (a `multiprocessing` process) came from a fork server."""
    return getattr(proc, "_start_method", None) == "forkserver"


def _stop_orphaned_forks(procs: list[Any], kill_after: float) -> None:
    """A fork server's children read as exited (`SERVER_GONE_EXIT`) once the server died, and
    may still run (their own parent was the server): SIGTERM, then SIGKILL, by pid."""
    lost = [p for p in procs if forked(p) and p.exitcode == SERVER_GONE_EXIT and pid_alive(p.pid)]
    for p in lost:
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + kill_after
    while time.monotonic() < deadline:  # not our children: nothing to wait on but /proc
        lost = [p for p in lost if pid_alive(p.pid)]
        if not lost:
            return
        time.sleep(0.05)
    for p in lost:
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGKILL)


def check_not_bootstrapping() -> None:
    """Exit quietly with `MAIN_GUARD_EXIT` when this process is a spawned child importing the script.

    A process started with ``spawn`` first imports the parent's main script (as
    ``__mp_main__``) to find the functions it will run. A script that calls `fit` or
    `launch` at module level, without ``if __name__ == "__main__":``, would start
    processes again from there; multiprocessing refuses with a traceback in every
    child. Here the child leaves silently with a status the parent recognises and
    explains in one line. The test: a module named ``__mp_main__`` is in ``sys.modules``
    (elsewhere that key is only multiprocessing's alias of ``__main__``, named
    ``__main__``) and no parent process is recorded yet (multiprocessing records it
    after the import, just before running the target).
    """
    mp_main = sys.modules.get("__mp_main__")
    if getattr(mp_main, "__name__", None) == "__mp_main__" and multiprocessing.parent_process() is None:
        # at once, not SystemExit: a process forked from the fork server turns any SystemExit
        # in its start-up into status 1 (its `os._exit` in a ``finally``)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(MAIN_GUARD_EXIT)


def main_guard_message() -> str:
    """The line that explains `MAIN_GUARD_EXIT`, naming the caller's script."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "your script"
    return (f"partrain: {script} calls fit/launch at import time; worker processes import it again. "
            f'Put the call under `if __name__ == "__main__":`')
