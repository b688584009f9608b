"""The parameter server's wire format: message kinds, headers, shard plans.

Every message between a worker and a server is a fixed-size float64 *header*
followed by zero or more payload tensors; requests travel on `TAG`, replies on
`TAG_REPLY` (a colocated process is both a worker and a server: the two
directions from one peer must not meet), so point-to-point FIFO order per
(peer, tag) keeps a message's parts together. The hot messages are one *frame*
each, one uint8 buffer (`frame`): a push is header | hyperparameters |
gradient, the reply header | parameters. A receiver posts a buffer as large
as the largest message it may get (gloo fills a prefix of a larger buffer) and
reads the sizes from the header. Payloads are tensors:
gradients and parameters as flat buffers in the parameters' dtype,
hyperparameters as float64, metadata as JSON in a uint8 tensor, frozen
masks as uint8. Nothing is pickled.

Invariant that keeps the protocol simple: a worker has at most one request
in flight per server, and posts the receives for the reply *before* sending
the request (gloo sends block until the matching receive is posted).

Vocabulary: *version* ``V`` of a shard = how many updates its server applied
(one per averaged round in sync mode, one per gradient otherwise); a worker's
*clock* = how many gradients it pushed; *staleness* of a gradient = updates
applied to the shard between the pull it was computed on and its own update.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import queue
import time
from typing import Any

import torch
import torch.distributed as dist

TAG = 7301  # worker -> server
TAG_REPLY = 7302  # server -> worker
HEADER = 8
HEADER_BYTES = HEADER * 8

# worker -> server
HELLO, PUSH, PULL, DONE, STATS, STATE_GET, STATE_SET, REDUCE = range(1, 9)
# server -> worker
R_PARAMS, R_JSON, R_STATE, R_ACK, R_REDUCE = range(101, 106)

OP_NAMES = {HELLO: "hello", PUSH: "push", PULL: "pull", DONE: "done", STATS: "stats",
            STATE_GET: "state_get", STATE_SET: "state_set", REDUCE: "reduce"}


def header(op: int, *fields: float) -> torch.Tensor:
    """A header tensor: ``[op, *fields]`` padded with zeros to `HEADER` float64 slots."""
    h = torch.zeros(HEADER, dtype=torch.float64)
    h[0] = op
    for i, v in enumerate(fields):
        h[1 + i] = v
    return h


def frame(head: torch.Tensor, parts: list[tuple[int, torch.dtype]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One uint8 buffer holding ``head`` and room for ``parts`` ((numel, dtype) each); returns
    the buffer and a typed view of each part, to be filled in place (one message, no copy)."""
    buf = torch.empty(frame_bytes(parts), dtype=torch.uint8)
    buf[:HEADER_BYTES].view(torch.float64).copy_(head)
    return buf, split_frame(buf, parts)[1]


def split_frame(buf: torch.Tensor, parts: list[tuple[int, torch.dtype]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The header and typed views of ``parts`` in a frame (the inverse of `frame`)."""
    views, offset = [], HEADER_BYTES
    for n, dtype in parts:
        nb = n * dtype.itemsize
        if offset + nb > buf.numel():
            raise RuntimeError(f"Expected a parameter-server frame of at least {offset + nb} bytes. Received: "
                               f"{buf.numel()}")
        views.append(buf[offset:offset + nb].view(dtype))
        offset += _padded(nb)
    return buf[:HEADER_BYTES].view(torch.float64), views


def frame_bytes(parts: list[tuple[int, torch.dtype]]) -> int:
    return HEADER_BYTES + sum(_padded(n * d.itemsize) for n, d in parts)


def _padded(nbytes: int) -> int:
    """Parts start at multiples of 8 bytes, so any dtype can view its part."""
    return -(-nbytes // 8) * 8


def encode_json(obj: Any) -> torch.Tensor:
    """JSON as a uint8 tensor (metadata crosses process boundaries as bytes, never pickle)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def decode_json(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.numpy().tobytes()).decode())


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def plan_shards(numels: list[int], servers: int) -> list[list[int]]:
    """Which parameter tensors each server owns: greedy by size, largest first.

    Deterministic (ties by index), so every worker derives the same plan from the
    same model. Returns, per server, the parameter indices in increasing order.
    """
    loads = [0] * servers
    owned: list[list[int]] = [[] for _ in range(servers)]
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        s = min(range(servers), key=lambda s: (loads[s], s))
        owned[s].append(i)
        loads[s] += numels[i]
    return [sorted(o) for o in owned]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"Expected a torch dtype name. Received: {name!r}")
    return dtype


def send_tensors(tensors: list[torch.Tensor], dst: int, group: Any, tag: int = TAG_REPLY) -> int:
    """Blocking sends of ``tensors`` to global rank ``dst``; returns the bytes sent."""
    total = 0
    for t in tensors:
        dist.send(t.contiguous(), dst, group=group, tag=tag)
        total += nbytes(t)
    return total


def isend_tensors(tensors: list[torch.Tensor], dst: int, group: Any, tag: int = TAG) -> list[Any]:
    return [dist.isend(t, dst, group=group, tag=tag) for t in tensors]


def flat_masks(masks: list[torch.Tensor]) -> torch.Tensor:
    """Boolean masks as one flat uint8 tensor (a byte per element: any backend sends it)."""
    return torch.cat([m.reshape(-1).to("cpu", torch.uint8) for m in masks])


def split_masks(flat: torch.Tensor, shapes: list[list[int]]) -> list[torch.Tensor]:
    """The inverse of `flat_masks`: boolean masks of ``shapes``."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset:offset + n].view(shape).bool())
        offset += n
    return out


def describe_tensors(tensors: list[torch.Tensor]) -> list[list[Any]]:
    """``[[dtype, shape], ...]`` so a receiver can allocate before receiving."""
    return [[dtype_name(t.dtype), list(t.shape)] for t in tensors]


def recv_described(spec: list[list[Any]], irecv: Any, timeout: float) -> list[torch.Tensor]:
    """Receive the tensors announced by `describe_tensors` through ``irecv(tensor) -> work``, in
    order, each wait bounded."""
    out = []
    for dtype, shape in spec:
        t = torch.empty(shape, dtype=dtype_from(dtype))
        irecv(t).wait(seconds(timeout))
        out.append(t)
    return out


class LocalPipe:
    """One direction between a worker and the server thread in its own process (colocated).

    Has gloo's point-to-point semantics, which the protocol relies on: messages
    arrive in the order sent, receives are filled in the order posted, and a
    receive buffer may be larger than its message (a prefix is filled). A sent
    tensor is copied at once, so the sender may reuse it (the server's reply buffer).
    ``failed`` (set by the other side's thread when it dies) ends every wait.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.failed: str | None = None
        self._messages: queue.Queue[torch.Tensor] = queue.Queue()
        self._posted: collections.deque[_LocalRecv] = collections.deque()

    def isend(self, t: torch.Tensor) -> Any:
        self._messages.put(t.detach().reshape(-1).view(torch.uint8).clone())
        return _DONE

    def irecv(self, t: torch.Tensor) -> Any:
        work = _LocalRecv(self, t)
        self._posted.append(work)
        return work

    def _fill_next(self, timeout: float) -> bool:
        try:
            msg = self._messages.get(timeout=timeout)
        except queue.Empty:
            return False
        target = self._posted.popleft()
        room = target.tensor.reshape(-1).view(torch.uint8)
        if msg.numel() > room.numel():
            raise RuntimeError(f"{self.name}: message of {msg.numel()} bytes for a {room.numel()}-byte buffer")
        room[:msg.numel()].copy_(msg)
        target.done = True
        return True


class _LocalRecv:
    def __init__(self, pipe: LocalPipe, tensor: torch.Tensor) -> None:
        self.pipe = pipe
        self.tensor = tensor
        self.done = False

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        limit = timeout.total_seconds() if timeout is not None else math.inf
        deadline = time.monotonic() + limit
        while not self.done:
            if not self.pipe._fill_next(min(0.5, max(0.0, deadline - time.monotonic()))):
                if self.pipe.failed is not None:
                    raise RuntimeError(f"{self.pipe.name}: {self.pipe.failed}")
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"{self.pipe.name}: no message within {limit:g} s")
        return True


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


_DONE = _Done()
