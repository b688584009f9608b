"""What one process's training holds in memory: an accounting by kind, and the measured peak.

Every strategy is asked the same way, so that ``allreduce``, ``fsdp``, ``tp`` and ``pipeline``
compare row by row:

- *state* (`state_bytes`): the bytes of this process's parameters, their gradients and the
  optimizer's state, counted from the tensors it holds: a sharded parameter (a DTensor: ``fsdp``,
  ``tp``) counts its local shard, a parameter on the meta device (a pipeline stage's neighbours)
  nothing. Gradients count as large as the parameters that train, whether a step holds them now
  or not (they exist during every step). Buffers a strategy adds (DDP's gradient buckets) are
  not counted: they show in the peak.
- *activations* (`ActivationMeter`): the bytes autograd saved for the backward during one
  training step (``torch.autograd.graph.saved_tensors_hooks``), each storage once, the
  parameters (and the views of them that layers save) left out. Activation checkpointing
  saves less, and is counted as such (its own hooks take what it recomputes).
- *peak*: measured. On CPU the process's peak resident set (``getrusage``: everything, the
  interpreter and torch's libraries included, so compare it between runs rather than with the
  accounting); on CUDA also ``torch.cuda.max_memory_allocated`` (the caching allocator's own
  count of tensor bytes, correct by construction).

`MemoryMeter` is what the training loop holds: it watches the first step's activations and,
asked at the end of each epoch, returns the figures of this process (`MemoryMeter.figures`).
"""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ._compat import dtensor_class

#: the figures of one process, in bytes, as the run's rows name them (``memory_<kind>``)
KINDS = ("params", "grads", "optimizer", "activations", "peak")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this process holds: its storage, so in-place changes reach the
    DTensor), or ``t``."""
    return t.to_local() if isinstance(t, dtensor_class()) else t  # type: ignore[attr-defined]


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes this process holds for ``t``: its local shard, nothing on the meta device."""
    local = local_tensor(t)
    return 0 if local.is_meta else local.numel() * local.element_size()


def state_bytes(model: nn.Module, optimizer: Optimizer | None = None) -> dict[str, int]:
    """This process's bytes of parameters, gradients (of the parameters that train) and
    optimizer state (every tensor it holds per parameter, Adam's two moments, momentum)."""
    params = list(model.parameters())
    param_bytes = sum(tensor_bytes(p) for p in params)
    grad_bytes = sum(tensor_bytes(p) for p in params if p.requires_grad)
    optimizer_bytes = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            optimizer_bytes += sum(tensor_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return {"params": param_bytes, "grads": grad_bytes, "optimizer": optimizer_bytes}


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started (``getrusage``; Linux counts KiB,
    macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``; the peak where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


class ActivationMeter:
    """Counts the bytes autograd saves for the backward inside its ``with`` block.

    Each storage counts once (an activation saved by two layers, or as a view, is one); a
    parameter, a view of one, or a storage in ``exclude`` (parameters' local shards) is not an
    activation. The count never changes what autograd does: the pack hook returns the tensor.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.bytes = 0
        self._seen: set[int] = set()
        self._exclude = {_storage_ptr(local_tensor(t)) for t in exclude}

    @contextlib.contextmanager
    def counting(self) -> Iterator[ActivationMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            base = t._base if t._base is not None else t
            if isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad):
                return t
            local = local_tensor(t)
            if local.is_meta:
                return t
            ptr = _storage_ptr(local)
            if ptr in self._exclude or ptr in self._seen:
                return t
            self._seen.add(ptr)
            self.bytes += local.untyped_storage().nbytes()
        except Exception:  # a tensor without a storage (a subclass): counting must never break a step
            pass
        return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # no storage to point at
        return -1


class MemoryMeter:
    """One process's memory during a run: `watch` the first training step (activations), then
    `figures` at the end of each epoch (state, activations, peak), as `KINDS` names them."""

    def __init__(self, device: torch.device, count_activations: bool = True) -> None:
        self.device = device
        #: bytes saved for the backward by the first step watched (None: none watched yet)
        self.activations: int | None = None
        self._count = count_activations

    def watch(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Around one training step: the first counts its activations, later ones nothing."""
        if self.activations is not None or not self._count:
            return contextlib.nullcontext()
        return self._first_step(model)

    @contextlib.contextmanager
    def _first_step(self, model: nn.Module) -> Iterator[None]:
        meter = ActivationMeter(exclude=model.parameters())
        with meter.counting():
            yield
        self.activations = meter.bytes

    def figures(self, model: nn.Module, optimizer: Optimizer | None) -> dict[str, float]:
        """This process's bytes by kind (`KINDS`), and on CUDA ``cuda_peak`` too."""
        out: dict[str, float] = {k: float(v) for k, v in state_bytes(model, optimizer).items()}
        out["activations"] = float(self.activations) if self.activations is not None else float("nan")
        out["peak"] = float(peak_rss_bytes())
        if self.device.type == "cuda":
            out["cuda_peak"] = float(torch.cuda.max_memory_allocated(self.device))
        return out


def per_rank(figures: list[dict[str, float]]) -> dict[str, Any]:
    """The run row's memory columns from every process's `MemoryMeter.figures`: each kind's
    largest over the processes (``memory_<kind>``: what one process must hold), and the
    processes' own figures (``memory_ranks``), in rank order."""
    row: dict[str, Any] = {}
    for key in figures[0]:
        values = [f.get(key, float("nan")) for f in figures]
        finite = [v for v in values if v == v]
        row[f"memory_{key}"] = max(finite) if finite else float("nan")
    row["memory_ranks"] = [{k: v for k, v in f.items()} for f in figures]
    return row


def human_bytes(n: float) -> str:
    """``12.3MB``: bytes in the largest unit that keeps them >= 1 (decimal units)."""
    if n != n:
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}TB"  # pragma: no cover - the loop returns at GB


def summary(row: dict[str, Any]) -> str:
    """The epoch line's memory part: ``mem/rank state 16.0MB (p 4.0MB g 4.0MB opt 8.0MB) act 3.1MB
    peak 612.0MB`` (the largest process's figures), empty when the row has none."""
    if "memory_params" not in row:
        return ""
    p, g, o = row["memory_params"], row["memory_grads"], row["memory_optimizer"]
    peak = row.get("memory_cuda_peak", row["memory_peak"])
    where = "cuda " if "memory_cuda_peak" in row else "rss "
    return (f"  mem/rank state {human_bytes(p + g + o)} (p {human_bytes(p)} g {human_bytes(g)} "
            f"opt {human_bytes(o)}) act {human_bytes(row['memory_activations'])} peak {where}{human_bytes(peak)}")
