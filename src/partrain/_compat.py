"""Every call into torch that depends on its version or reaches into a private name, in one place.

partrain supports ``torch>=2.4`` and is tested on 2.13. Where torch renamed an argument,
added an option or keeps a value behind a private name, the probe lives here, with the
fallback used when the probe fails and a test (`tests/test_compat.py`) that checks the
answer against what this torch does. Nothing else in partrain imports a private torch name
(a base class to subclass, such as ``_BatchNorm``, excepted).
"""

from __future__ import annotations

import datetime
import functools
import inspect
from typing import Any

import torch


@functools.cache
def ddp_accepts(name: str) -> bool:
    """Whether ``DistributedDataParallel`` takes the keyword argument ``name``."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        return name in inspect.signature(DistributedDataParallel.__init__).parameters
    except (TypeError, ValueError):  # no signature to read: the long-standing names only
        return name == "broadcast_buffers"


def ddp_buffer_sync(enabled: bool) -> dict[str, bool]:
    """DDP's keyword for "send rank 0's buffers before each forward": torch 2.13 calls it
    ``forward_sync_buffers``, older releases ``broadcast_buffers``."""
    return {"forward_sync_buffers" if ddp_accepts("forward_sync_buffers") else "broadcast_buffers": enabled}


@functools.cache
def batchnorm_takes_bias() -> bool:
    """Whether torch's batch norm takes ``bias=False`` (an affine norm without a shift; recent releases)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    try:
        return "bias" in inspect.signature(_BatchNorm.__init__).parameters
    except (TypeError, ValueError):
        return False


def optimizer_step_dtype() -> torch.dtype:
    """The dtype ``torch.optim``'s Adam keeps its ``step`` count in (not fused): float64 when the
    default dtype is, else float32. torch's own answer where it has one (a private function)."""
    try:
        from torch.optim.optimizer import _get_scalar_dtype

        return _get_scalar_dtype()
    except ImportError:
        return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def mark_static_address(t: torch.Tensor) -> None:
    """Tell ``torch.compile`` that ``t`` keeps its address (CUDA graphs record it instead of
    copying); unguarded, so a new address records again. Nothing where torch lacks the call."""
    mark = getattr(getattr(torch, "_dynamo", None), "mark_static_address", None)
    if mark is None:
        return
    try:
        mark(t, guard=False)
    except TypeError:  # a release without the guard keyword
        mark(t)


def process_group_timeout(group: Any) -> float | None:
    """The collective timeout, in seconds, of a process group partrain did not create (a
    script's own under torchrun), read from torch's private backend options; None when it
    cannot be read. partrain's own groups record theirs (`partrain.comm.group_timeout`)."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, TypeError):
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    return float(timeout) if isinstance(timeout, (int, float)) else None


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``t`` into ``out`` (``world * t.numel()`` values, in rank order), one collective:
    ``all_gather_single`` where torch has it (2.13), else ``all_gather_into_tensor``."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)


def checkpoint_activations(module: torch.nn.Module) -> None:
    """Recompute ``module``'s activations in the backward pass instead of keeping them, without
    changing its parameters' names (``torch.distributed._composable.checkpoint``, which FSDP2
    composes with; before it, ``torch.utils.checkpoint`` around its forward)."""
    try:
        from torch.distributed._composable import checkpoint
    except ImportError:  # pragma: no cover - older torch
        import functools

        from torch.utils.checkpoint import checkpoint as call

        forward = module.forward
        module.forward = functools.partial(call, forward, use_reentrant=False)  # type: ignore[method-assign]
        return
    checkpoint(module)


def fsdp2() -> Any:
    """FSDP2's public module (``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``,
    ``CPUOffloadPolicy``): ``torch.distributed.fsdp`` since torch 2.6, before it the private
    ``torch.distributed._composable.fsdp``."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "fully_shard"):
        return fsdp
    from torch.distributed._composable import fsdp as composable  # pragma: no cover - torch < 2.6

    return composable


def dtensor_class() -> type:
    """``DTensor``: ``torch.distributed.tensor.DTensor`` since torch 2.5, before it the private
    ``torch.distributed._tensor.DTensor``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.5
        from torch.distributed._tensor import DTensor
    return DTensor


def dtensor_module() -> Any:
    """DTensor's module (``DTensor``, ``Shard``, ``Replicate``, ``distribute_tensor``,
    ``distribute_module``): ``torch.distributed.tensor`` since torch 2.5, before it the private
    ``torch.distributed._tensor``."""
    import torch.distributed.tensor as dt

    if hasattr(dt, "distribute_module"):
        return dt
    from torch.distributed import _tensor  # pragma: no cover - torch < 2.5

    return _tensor


def apply_to_tensors(module: torch.nn.Module, fn: Any) -> torch.nn.Module:
    """``fn`` applied to every parameter and buffer of ``module`` in place, as ``Module.to`` applies
    its move (torch's private ``Module._apply``: ``to`` cannot leave some tensors where they are)."""
    return module._apply(fn)


def dcp_file_reader(path: str, read_metadata: Any) -> Any:
    """``torch.distributed.checkpoint.FileSystemReader(path)`` whose ``.metadata`` is read by
    ``read_metadata(path)`` instead of torch's plain ``pickle.load`` (which would run any code a
    file holds). The override repeats what torch's ``read_metadata`` does after unpickling (a
    ``StorageMeta`` carrying the reader's ``load_id``), as torch 2.4 - 2.13 do; a per-rank
    metadata file (``rank=``, not written by partrain) is left to torch."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                return super().read_metadata(*args, **kwargs)
            metadata = read_metadata(str(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    return SafeFileSystemReader(path)



@functools.cache
def engine_backward() -> Any:
    """torch's own call into the autograd engine under ``Tensor.backward`` (private), if it takes
    the arguments `backward_with` passes (tried once on a one-value graph), else None."""
    try:
        from torch.autograd.graph import _engine_run_backward
    except ImportError:
        return None
    leaf = torch.zeros(1, requires_grad=True)
    try:
        _engine_run_backward((leaf * 2,), (torch.ones(1),), False, False, (), allow_unreachable=True,
                             accumulate_grad=True)
    except (TypeError, RuntimeError):
        return None
    return _engine_run_backward if leaf.grad is not None and float(leaf.grad) == 2.0 else None


def backward_with(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` for a ``grad`` the caller made with ``output``'s shape, dtype and
    device: straight into the engine, as ``torch.autograd.backward`` ends, without its checks of
    the gradient against the output (about 20 us of Python a step, a fifth of a small model's
    whole step on the CPU). Tensor subclasses (a DTensor loss) take ``backward`` and its dispatch."""
    engine = engine_backward()
    if engine is not None and type(output) is torch.Tensor and type(grad) is torch.Tensor:
        engine((output,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)
    else:
        output.backward(grad)
