"""Tensors between the processes of a pipeline outside torch's schedules (evaluation, outputs):
a fixed-size header (dtype, rank, shape), then the data. Every call goes through c10d and
inherits the process group's timeout."""

from __future__ import annotations

import copy
from collections.abc import Mapping
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


def _on(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors on ``device``, its containers' types kept (a Hugging Face
    ``ModelOutput`` stays one: callers read ``.logits``)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device)
    if isinstance(obj, Mapping):
        moved = copy.copy(obj)
        for key, value in obj.items():
            moved[key] = _on(value, device)  # type: ignore[index]
        return moved
    if isinstance(obj, (tuple, list)):
        moved_items = [_on(v, device) for v in obj]
        return type(obj)(*moved_items) if hasattr(obj, "_fields") else type(obj)(moved_items)
    return obj


def broadcast_output(out: Any, src: int, group: Any, me: int, device: torch.device) -> Any:
    """A model's output from ``src`` on every process of ``group``: one tensor as `broadcast_tensor`
    sends it; any other structure pickled (between the job's own processes), tensors on the CPU."""
    flag = torch.tensor([int(isinstance(out, torch.Tensor))] if me == src else [0], dtype=torch.int64)
    flag = flag.to(device)
    dist.broadcast(flag, src=src, group=group)
    if int(flag.item()):
        return broadcast_tensor(out, src, group, me, "the model's output", device)
    box = [_on(out, torch.device("cpu")) if me == src else None]
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return _on(box[0], device)
