"""Small typed helpers over torch.distributed.

Every call here goes through c10d, so it inherits the process group's timeout:
a dead peer becomes an error after that timeout, never a hang. With no
initialized process group they act as the identity (world of one).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

Group = Any  # torch.distributed.ProcessGroup | None (None = the default group)

# the collective timeout (seconds) of each process group partrain made, by group: a helper
# that waits outside c10d (a shared-memory exchange) bounds its wait by the same number
_TIMEOUTS: dict[Any, float] = {}


def init_process_group(backend: str, *, timeout: float, **options: Any) -> None:
    """``torch.distributed.init_process_group`` with ``timeout`` seconds, recorded (`group_timeout`)."""
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **options)
    _TIMEOUTS[dist.group.WORLD] = float(timeout)


def new_group(ranks: Sequence[int], *, timeout: float, **options: Any) -> Any:
    """``torch.distributed.new_group`` with ``timeout`` seconds, recorded (`group_timeout`)."""
    group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout), **options)
    _TIMEOUTS[group] = float(timeout)
    return group


def group_timeout(group: Group = None) -> float:
    """The collective timeout of ``group`` in seconds: the one partrain made it with; for a
    group made elsewhere what torch keeps (`partrain._compat.process_group_timeout`), else
    torch's default."""
    pg = group if group is not None else dist.group.WORLD
    if pg in _TIMEOUTS:
        return _TIMEOUTS[pg]
    from ._compat import process_group_timeout

    seconds = process_group_timeout(pg)
    return seconds if seconds is not None else dist.default_pg_timeout.total_seconds()


def forget_groups() -> None:
    """Drop the recorded timeouts (the default group was destroyed)."""
    _TIMEOUTS.clear()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def group_size(group: Group = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def all_reduce_sum(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum ``tensor`` in place across ``group``; returns it.

    A CPU tensor under NCCL (metrics, counters) travels through the GPU and back:
    NCCL only reduces device tensors.
    """
    if is_distributed() and group_size(group) > 1:
        device = _group_device(group)
        if tensor.device != device:
            staged = tensor.to(device)
            dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=group)
            tensor.copy_(staged)
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_mean(tensor: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Average ``tensor`` in place across ``group``; returns it."""
    n = group_size(group)
    all_reduce_sum(tensor, group)
    if n > 1:
        tensor.div_(n)
    return tensor


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one flat buffer (one collective instead of many)."""
    if not tensors:
        return torch.empty(0)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Iterable[torch.Tensor]) -> None:
    """Copy a flat buffer back into ``tensors`` (the inverse of `flatten`)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int = 0, group: Group = None) -> None:
    """Make every rank's ``tensors`` equal to those of ``src``, in one flat broadcast."""
    if not is_distributed() or group_size(group) <= 1 or not tensors:
        return
    flat = flatten([t.detach() for t in tensors])
    dist.broadcast(flat, src=src, group=group)
    with torch.no_grad():
        unflatten_into(flat, tensors)


def broadcast_into(tensor: torch.Tensor, src: int, group: Group = None) -> torch.Tensor:
    """``tensor`` made equal to ``src``'s on every rank of ``group``, in place (a CPU tensor goes
    through the device NCCL needs and back)."""
    device = _group_device(group)
    staged = tensor.to(device) if tensor.device != device else tensor
    dist.broadcast(staged, src=src, group=group)
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


def broadcast_object(obj: Any, src: int = 0, group: Group = None) -> Any:
    """Broadcast a small picklable object (between the processes of one job only)."""
    if not is_distributed() or group_size(group) <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Group = None) -> list[Any]:
    """Gather one small picklable object from every rank of ``group``."""
    if not is_distributed() or group_size(group) <= 1:
        return [obj]
    out: list[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Group = None) -> None:
    """Wait for every rank of ``group`` (bounded by the group's timeout).

    Implemented as a tiny all-reduce: gloo's and NCCL's barriers differ in how
    they honour timeouts, an all-reduce honours the group's timeout on both.
    """
    if is_distributed() and group_size(group) > 1:
        dist.all_reduce(torch.zeros(1, device=_group_device(group)), group=group)


def _group_device(group: Group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
