"""HostExchange: shared-memory all-gathers between the ranks of one host, checked against what each rank sent.

One launch of 3 ranks covers: rows equal every rank's input over many calls (the
double-buffered slots are reused every other call) for several dtypes and sizes,
an empty row, a row too large for a slot (None: the caller's collective); the
group timeout when a rank does not arrive and a peer whose process exited (errors,
not hangs); the agreement
(a rank with ``PARTRAIN_HOST_EXCHANGE=0``, one that cannot see the segment as on
another host, or no room for it on /dev/shm makes every rank of that group keep gloo).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import partrain
from partrain import host_exchange
from partrain.host_exchange import SLOT_BYTES, ExchangeError, HostExchange

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX shared memory on Linux only")

CALLS = 300


def row(rank: int, call: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """What rank ``rank`` sends in call ``call``: distinct per rank and call."""
    return (torch.arange(n, dtype=torch.float64) + 1000 * rank + call).to(dtype)


def worker(strategy, monkeypatch_env: str):
    rank, world = strategy.rank, dist.get_world_size()
    out: dict[str, object] = {"pid": os.getpid()}
    exchange = HostExchange.for_group(None)
    out["world"] = exchange is not None and exchange.world == world
    mismatches = 0
    shapes = [(torch.float64, 193), (torch.float32, 7), (torch.int64, 1), (torch.float64, 0)]
    for call in range(CALLS):
        dtype, n = shapes[call % len(shapes)]
        rows = exchange.all_gather(row(rank, call, dtype, n))
        expected = torch.stack([row(r, call, dtype, n) for r in range(world)])
        mismatches += not (rows.dtype == dtype and rows.shape == (world, n) and torch.equal(rows, expected))
    out["mismatches"] = mismatches
    out["too_large"] = exchange.all_gather(torch.zeros(SLOT_BYTES // 8 + 1, dtype=torch.float64))

    # the agreement: one rank with the exchange switched off, then one that cannot see the segment
    if rank == 2:
        os.environ[monkeypatch_env] = "0"
    out["off"] = HostExchange.for_group(dist.new_group(list(range(world))))
    os.environ.pop(monkeypatch_env, None)
    if rank == 1:
        real = host_exchange._shm_path
        host_exchange._shm_path = lambda token: real(token) + "-elsewhere"
    out["elsewhere"] = HostExchange.for_group(dist.new_group(list(range(world))))
    if rank == 1:
        host_exchange._shm_path = real
    # no room on /dev/shm where rank 0 makes the segment
    if rank == 0:
        fallocate = os.posix_fallocate
        os.posix_fallocate = _no_space
    out["full"] = HostExchange.for_group(dist.new_group(list(range(world))))
    if rank == 0:
        os.posix_fallocate = fallocate

    # a rank that does not arrive: the other gets the timeout error
    pair = dist.new_group([0, 1])
    if rank < 2:
        ex = HostExchange.for_group(pair)
        if rank == 0:
            ex.timeout = 0.2
            try:
                ex.all_gather(torch.zeros(3))
            except ExchangeError as exc:
                out["timeout"] = str(exc)
            # a peer whose process has exited: an error at the next check, long before the timeout
            out["peers"] = dict(ex._peers)
            ex.timeout, ex._peers = 600, {1: _exited_pid()}
            try:
                ex.all_gather(torch.zeros(3))
            except ExchangeError as exc:
                out["exited"] = str(exc)
    return out


def _no_space(fd: int, offset: int, length: int) -> None:
    raise OSError(28, "No space left on device")


def _exited_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_rows_agreement_and_timeout():
    results = partrain.launch(worker, host_exchange._ENV, workers=3, timeout=60)
    for rank, r in enumerate(results):
        assert r["world"], rank
        assert r["mismatches"] == 0, rank
        assert r["too_large"] is None
        assert r["off"] is None and r["elsewhere"] is None and r["full"] is None, rank
    message = results[0]["timeout"]
    assert "Expected all 2 ranks" in message and "Received: 0 of 1" in message
    assert results[0]["peers"] == {1: results[1]["pid"]}
    assert "rank 1's process" in results[0]["exited"] and "has exited" in results[0]["exited"]
