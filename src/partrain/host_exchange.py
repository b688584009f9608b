"""Small all-gathers between the ranks of one host through shared memory.

A gloo collective of a few hundred numbers between two processes on one host
costs 0.6-1.4 ms at the median and several ms at the 90th percentile: TCP over
loopback plus hand-offs between the caller's thread and gloo's. SyncBatchNorm
makes two such exchanges per layer and step, and on CPU they were most of its
cost. When every rank of a process group shares one host, `HostExchange` moves
the same bytes through one shared-memory segment: each rank copies its row into
its slot, tells every other rank so with a POSIX semaphore, waits for theirs
and reads all rows. A call costs a few microseconds plus the wait for the
slowest rank.

How it stays correct:

- **Agreement.** `HostExchange.for_group` is collective (every rank of the group
  calls it, at the same point of its program). Group rank 0 creates the segment
  and one semaphore per rank under a random name and broadcasts the name's
  token with a gloo broadcast; every rank opens them and checks the token
  written inside the segment (a rank on another host, or in a container with
  its own ``/dev/shm``, cannot see it); an all-reduce of "opened" flags decides
  for everyone, and rank 0 then unlinks the names (the mappings live on). Any
  rank that cannot take part makes the whole group keep gloo.
- **Ordering.** Call ``k`` uses slot ``k % 2`` (double buffering). A rank writes
  its row, posts once to every other rank's semaphore and waits for ``W - 1``
  posts on its own. No rank leaves call ``k`` before every rank has written
  call ``k`` (a rank that got ``W - 1`` posts has one per peer: a peer's post for
  call ``k + 1`` needs everyone's post for ``k`` first), and no rank writes call
  ``k + 2`` into the slot of call ``k`` before every rank has read call ``k``.
  ``sem_post``/``sem_wait`` order the memory accesses around them (release and
  acquire), on any architecture.
- **No hang.** A wait spins briefly (`SPIN_SECONDS`, free when the peers are
  about to arrive), then sleeps in ``sem_timedwait``. Every `CHECK_SECONDS` it
  looks whether each peer's process still exists (pids from the segment's
  header; a dead peer is an error at once, as gloo's closed socket would be),
  and at the group's timeout it raises `ExchangeError` naming what it waited for.

Linux only (named POSIX semaphores and ``/dev/shm`` through ctypes); elsewhere,
with ``PARTRAIN_HOST_EXCHANGE=0``, for CUDA tensors or rows larger than a slot
`all_gather` answers None and the caller uses its collective.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import secrets
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .comm import group_timeout

Group = Any  # torch.distributed.ProcessGroup | None (None = the default group)

#: bytes per rank and slot: rows up to this size go through shared memory (SyncBatchNorm's
#: largest row, 3C+1 float64 numbers, fits up to C = 10,922 channels)
SLOT_BYTES = 1 << 18
#: how long a wait polls before it sleeps in the kernel
SPIN_SECONDS = 50e-6
_ENV = "PARTRAIN_HOST_EXCHANGE"
_MAGIC = b"partrain-host-exchange"
#: a sleeping wait wakes this often to see whether every peer's process is still there
CHECK_SECONDS = 0.5


def _header_bytes(world: int) -> int:
    """Bytes before the slots: magic and token (32), then each rank's pid (8 each), rounded up to 64."""
    return -(-(32 + 8 * world) // 64) * 64


class ExchangeError(RuntimeError):
    """A rank did not reach a shared-memory exchange: its process exited, or the group's timeout passed."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Semaphores:
    """The few libc calls of named POSIX semaphores (glibc), loaded once."""

    _loaded: _Semaphores | None = None

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        if not hasattr(libc, "sem_timedwait"):
            libc = ctypes.CDLL(ctypes.util.find_library("pthread"), use_errno=True)  # glibc < 2.34
        self.open = libc.sem_open
        self.open.restype = ctypes.c_void_p
        self.open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
        for name in ("sem_post", "sem_trywait", "sem_close"):
            fn = getattr(libc, name)
            fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
            setattr(self, name[4:], fn)
        self.timedwait = libc.sem_timedwait
        self.timedwait.restype = ctypes.c_int
        self.timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
        self.unlink = libc.sem_unlink
        self.unlink.restype, self.unlink.argtypes = ctypes.c_int, [ctypes.c_char_p]

    @classmethod
    def get(cls) -> _Semaphores | None:
        if cls._loaded is None and sys.platform.startswith("linux"):
            try:
                cls._loaded = cls()
            except (OSError, AttributeError, TypeError):
                return None
        return cls._loaded


_SEM_FAILED = ctypes.c_void_p(-1).value


class HostExchange:
    """All-gathers of small CPU tensors among the ranks of one group, all on this host."""

    _groups: weakref.WeakKeyDictionary[Any, HostExchange | None] = weakref.WeakKeyDictionary()

    def __init__(self, sems: _Semaphores, world: int, rank: int, handles: list[int], view: mmap.mmap,
                 timeout: float) -> None:
        self._sems, self.world, self.rank = sems, world, rank
        self._handles, self._mine = handles, handles[rank]
        self._others = [h for r, h in enumerate(handles) if r != rank]
        self._map = view
        self._bytes = torch.frombuffer(view, dtype=torch.uint8, offset=_header_bytes(world),
                                       count=2 * world * SLOT_BYTES).view(2, world, SLOT_BYTES)
        self.timeout = timeout
        self.calls = 0
        pids = [int.from_bytes(view[32 + 8 * r : 40 + 8 * r], "little") for r in range(world)]
        # peers whose process this rank can see (same pid namespace): a wait that sleeps checks
        # they are still there, so a rank that died is an error at once rather than at the timeout
        self._peers = {r: pid for r, pid in enumerate(pids) if r != rank and pid_alive(pid)}
        if len(self._peers) != world - 1:
            self._peers = {}

    # ----- setting up, once per group (collective)

    @classmethod
    def for_group(cls, group: Group) -> HostExchange | None:
        """The group's exchange, set up on first use (a collective: every rank calls it); None = use gloo."""
        pg = group if group is not None else dist.group.WORLD
        try:
            return cls._groups[pg]
        except KeyError:
            pass
        exchange = cls._agree(group)
        cls._groups[pg] = exchange
        return exchange

    @classmethod
    def _agree(cls, group: Group) -> HostExchange | None:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        sems = _Semaphores.get() if os.environ.get(_ENV, "1") != "0" else None
        size = _header_bytes(world) + 2 * world * SLOT_BYTES
        token = torch.zeros(1, dtype=torch.int64)
        created = None
        if rank == 0 and sems is not None:
            token[0] = secrets.randbits(62) + 1
            created = cls._create(sems, int(token), world, size)
            if created is None:
                token.zero_()
        try:
            src = dist.get_global_rank(group, 0) if group is not None else 0
            dist.broadcast(token, src=src, group=group)
            if int(token) == 0:
                return None  # rank 0 could not make one: every rank knows it from the token
            opened = created
            if rank != 0 and sems is not None:
                opened = cls._open(sems, int(token), world, size)
            if opened is not None:
                _write_pid(opened[1], rank)  # before the all-reduce below: every rank reads them after it
            flag = torch.tensor([1 if opened is not None else 0], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        finally:
            if created is not None:
                _unlink(sems, int(token), world)  # every rank has opened (or given up, or failed): the names go
        if int(flag) == 0:
            if opened is not None:
                _close(sems, *opened)
            return None
        handles, view = opened
        return cls(sems, world, rank, handles, view, group_timeout(group))

    @staticmethod
    def _create(sems: _Semaphores, token: int, world: int, size: int) -> tuple[list[int], mmap.mmap] | None:
        path = _shm_path(token)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            # reserved now: on a full /dev/shm (a container's 64 MB default) the first write to a
            # page that was only truncated into existence would be a SIGBUS, not an error
            os.posix_fallocate(fd, 0, size)
            view = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            return None
        os.close(fd)
        view[: len(_stamp(token))] = _stamp(token)
        handles = _semaphores(sems, token, world, create=True)
        if handles is None:
            view.close()
            _unlink(sems, token, world)
            return None
        return handles, view

    @staticmethod
    def _open(sems: _Semaphores, token: int, world: int, size: int) -> tuple[list[int], mmap.mmap] | None:
        try:
            fd = os.open(_shm_path(token), os.O_RDWR)
        except OSError:
            return None  # another host, or another /dev/shm
        try:
            view = mmap.mmap(fd, size)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        handles = _semaphores(sems, token, world, create=False) if view[: len(_stamp(token))] == _stamp(token) else None
        if handles is None:
            view.close()
            return None
        return handles, view

    # ----- the exchange

    def all_gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``t`` (same shape and dtype everywhere) as rows of a ``(W, t.numel())`` tensor.

        None when ``t`` does not fit a slot or is not a CPU tensor (the same answer on
        every rank, since every rank passes the same shape): the caller's collective then.
        """
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes > SLOT_BYTES:
            return None
        slot = self.calls % 2
        self.calls += 1
        if nbytes:
            self._bytes[slot, self.rank, :nbytes].view(t.dtype).copy_(t.reshape(-1))
        for handle in self._others:
            if self._sems.post(handle) != 0:
                raise OSError(ctypes.get_errno(), "sem_post failed in the host exchange")
        self._wait(self.world - 1)
        return self._bytes[slot, :, :nbytes].view(t.dtype).clone().view(self.world, t.numel())

    def _wait(self, posts: int) -> None:
        """Take ``posts`` posts from this rank's semaphore: spin a little, then sleep up to the timeout."""
        sems, mine = self._sems, self._mine
        got = 0
        spin_until = time.perf_counter() + SPIN_SECONDS
        while got < posts:
            if sems.trywait(mine) == 0:
                got += 1
            elif time.perf_counter() >= spin_until:
                break
        if got == posts:
            return
        deadline = time.time() + self.timeout
        while got < posts:
            now = time.time()
            if now >= deadline:
                raise ExchangeError(
                    f"Expected all {self.world} ranks at the shared-memory exchange (call {self.calls}) within "
                    f"{self.timeout:g} s, the process group's timeout. Received: {got} of {posts} other rank(s)")
            wake = min(deadline, now + CHECK_SECONDS)
            when = _Timespec(int(wake), int((wake % 1) * 1e9))
            if sems.timedwait(mine, ctypes.byref(when)) == 0:
                got += 1
                continue
            err = ctypes.get_errno()
            if err == errno.ETIMEDOUT:
                self._check_peers(got, posts)
            elif err != errno.EINTR:
                raise OSError(err, f"sem_timedwait failed in the host exchange: {os.strerror(err)}")

    def _check_peers(self, got: int, posts: int) -> None:
        for r, pid in self._peers.items():
            if not pid_alive(pid):
                raise ExchangeError(
                    f"Expected all {self.world} ranks at the shared-memory exchange (call {self.calls}). "
                    f"Received: {got} of {posts} other rank(s); rank {r}'s process (pid {pid}) has exited")

    def __del__(self) -> None:  # the group is gone: its semaphores' handles go too (the mapping with its tensor)
        for handle in getattr(self, "_handles", ()):
            self._sems.close(handle)


def _stamp(token: int) -> bytes:
    """What rank 0 writes at the segment's start: a rank that reads it back shares the memory."""
    return _MAGIC + token.to_bytes(8, "little")


def _semaphores(sems: _Semaphores, token: int, world: int, create: bool) -> list[int] | None:
    """One named semaphore per rank, created (rank 0) or opened; None (and none left open) on a failure."""
    handles = []
    for r in range(world):
        name = _sem_name(token, r)
        handle = sems.open(name, os.O_CREAT | os.O_EXCL, 0o600, 0) if create else sems.open(name, 0, 0, 0)
        if handle in (None, _SEM_FAILED):
            for opened in handles:
                sems.close(opened)
            return None
        handles.append(handle)
    return handles


def _write_pid(view: mmap.mmap, rank: int) -> None:
    view[32 + 8 * rank : 40 + 8 * rank] = os.getpid().to_bytes(8, "little")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists as this process sees it (a zombie counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _shm_path(token: int) -> str:
    return f"/dev/shm/partrain-x-{token:x}"


def _sem_name(token: int, rank: int) -> bytes:
    return f"/partrain-x-{token:x}-{rank}".encode()


def _close(sems: _Semaphores, handles: list[int], view: mmap.mmap) -> None:
    for handle in handles:
        sems.close(handle)
    try:
        view.close()
    except BufferError:
        pass  # a tensor still looks at it: the mapping goes with the process


def _unlink(sems: _Semaphores, token: int, world: int) -> None:
    for r in range(world):
        sems.unlink(_sem_name(token, r))
    try:
        os.unlink(_shm_path(token))
    except OSError:
        pass
