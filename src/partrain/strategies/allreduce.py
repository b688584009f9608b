"""``allreduce``: synchronous data parallel on DistributedDataParallel.

Every worker holds the whole model, computes gradients on its shard of the
global batch, and DDP averages them with bucketed all-reduces that overlap
the backward pass. Inner steps of gradient accumulation run under
``no_sync()``: gradients pile up locally and only the last micro-batch
communicates.

Measured: ``comm_seconds`` counts the time the backward pass waited on the
network after its last gradient bucket was ready (the communication that
did *not* overlap with compute); ``comm_bytes`` the bytes all-reduced.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from .._compat import ddp_buffer_sync
from .base import Strategy, register


@register
class AllReduce(Strategy):
    name = "allreduce"
    checkpoints_within_epoch = True
    averages_gradients = True
    fuses_steps = True

    def __init__(self, bucket_cap_mb: float = 25.0, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, gradient_as_bucket_view: bool = True) -> None:
        super().__init__()
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view

    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        model, optimizer = super().prepare(model, optimizer)
        if self.num_workers == 1:
            return model, optimizer  # nothing to synchronise: skip DDP's bookkeeping
        ddp = self.wrap(model, self.group)
        ddp.register_comm_hook(self, _timed_allreduce)
        return ddp, optimizer

    def wrap(self, model: nn.Module, group: Any = None) -> DistributedDataParallel:
        """``model`` (on its device) in DDP as `prepare` wraps it, over ``group`` (None: the
        default group): this strategy's buckets, buffer switch and gradient views, with DDP's own
        all-reduce (no timing hook; the caller may register its own). For code that inspects or
        times this strategy's DDP without training through it: ``partrain compare``'s host probe
        reads its bucket layout and its bookkeeping."""
        device = next(model.parameters()).device
        return DistributedDataParallel(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=group,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            **ddp_buffer_sync(self.broadcast_buffers),  # its name depends on torch's version
        )

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield


def _timed_allreduce(strategy, bucket):  # noqa: ANN001, ANN202 - DDP inspects these annotations
    """DDP's averaging all-reduce, timed: the last bucket's wait is what backward blocks on."""
    tensor = bucket.buffer()
    strategy.comm_bytes += tensor.numel() * tensor.element_size()
    tensor.div_(strategy.num_workers)
    ready = time.perf_counter()
    is_last = bucket.is_last()
    fut = dist.all_reduce(tensor, group=strategy.group, async_op=True).get_future()

    def done(f: torch.futures.Future[Any]) -> torch.Tensor:
        if is_last:
            strategy.comm_seconds += time.perf_counter() - ready
        return f.value()[0]

    return fut.then(done)
