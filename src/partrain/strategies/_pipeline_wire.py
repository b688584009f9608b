"""Tensors between the processes of a pipeline outside torch's schedules (evaluation, outputs):
a fixed-size header (dtype, rank, shape), then the data. Every call goes through c10d and
inherits the process group's timeout."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..batch import describe
from ..errors import UsageError

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]
_MAX_DIMS = 8


def _header(t: torch.Tensor | None) -> torch.Tensor:
    h = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    if t is None or not isinstance(t, torch.Tensor) or t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
        h[0] = -1  # nothing to send: the receivers raise too
        return h
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _empty_from(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    dims = int(h[1])
    return torch.empty(tuple(int(v) for v in h[2:2 + dims]), dtype=_DTYPES[int(h[0])], device=device)


def send_tensors(tensors: tuple[torch.Tensor, ...], dst: int, group: Any, device: torch.device) -> None:
    dist.send(torch.tensor([len(tensors)], dtype=torch.int64, device=device), dst=dst, group=group)
    for t in tensors:
        dist.send(_header(t).to(device), dst=dst, group=group)
        dist.send(t.detach().contiguous(), dst=dst, group=group)


def recv_tensors(src: int, group: Any, device: torch.device) -> tuple[torch.Tensor, ...]:
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(count, src=src, group=group)
    out = []
    for _ in range(int(count)):
        h = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
        dist.recv(h, src=src, group=group)
        t = _empty_from(h.cpu(), device)
        dist.recv(t, src=src, group=group)
        out.append(t)
    return tuple(out)


def broadcast_tensor(t: Any, src: int, group: Any, me: int, what: str,
                      device: torch.device = torch.device("cpu")) -> torch.Tensor:
    h = (_header(t) if me == src else torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)).to(device)
    dist.broadcast(h, src=src, group=group)
    h = h.cpu()
    if int(h[0]) < 0:
        raise UsageError(f"Expected {what} to be one tensor. Received: "
                         f"{describe(t) if me == src else 'something else, on rank ' + str(src)}")
    data = t.detach().contiguous() if me == src else _empty_from(h, device)
    dist.broadcast(data, src=src, group=group)
    return data
