"""The parameter server's wire format: message kinds, headers, shard plans.

Every message between a worker and a server is a fixed-size float64 *header*
followed by zero or more payload tensors, all on one tag, so point-to-point
FIFO order per (peer, tag) keeps them together. Payloads are tensors:
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

import datetime
import json
import math
from typing import Any

import torch
import torch.distributed as dist

TAG = 7301
HEADER = 8

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


def send_tensors(tensors: list[torch.Tensor], dst: int, group: Any) -> int:
    """Blocking sends of ``tensors`` to global rank ``dst``; returns the bytes sent."""
    total = 0
    for t in tensors:
        dist.send(t.contiguous(), dst, group=group, tag=TAG)
        total += nbytes(t)
    return total


def isend_tensors(tensors: list[torch.Tensor], dst: int, group: Any) -> list[Any]:
    return [dist.isend(t, dst, group=group, tag=TAG) for t in tensors]


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


def recv_described(spec: list[list[Any]], src: int, group: Any, timeout: float) -> list[torch.Tensor]:
    """Receive the tensors announced by `describe_tensors`, in order, each wait bounded."""
    out = []
    for dtype, shape in spec:
        t = torch.empty(shape, dtype=dtype_from(dtype))
        dist.irecv(t, src, group=group, tag=TAG).wait(seconds(timeout))
        out.append(t)
    return out
