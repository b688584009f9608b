"""Model parallel inside one process: consecutive layers on different devices.

``place(model, split, devices)`` cuts an ``nn.Sequential`` between its children into one
chunk per device (the classic ``tf.device`` placement: layers 0-3 on ``cuda:0``, 4-7 on
``cuda:1``), moves each chunk's parameters and buffers to its device, and moves the
activations between chunks as the forward pass crosses a boundary. Autograd follows the
copies back, so gradients land next to their parameters; build the optimizer over the
placed model's parameters afterwards.

It is correct by construction: the same children, called in the same order, under the
same names (``state_dict()`` keys are the original model's, so checkpoints load into an
unplaced model). It is not a pipeline: one device computes at a time; for concurrency use
the ``pipeline`` strategy, which runs micro-batches on each device in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .._tree import map_tensors
from ..errors import UsageError
from .split import chunk_ranges, plan_cuts, sequential_children


class PlacedSequential(nn.Module):
    """The children of an ``nn.Sequential``, each on the device of its chunk (see `place`)."""

    def __init__(self, children: list[tuple[str, nn.Module]], cuts: list[int], devices: list[torch.device],
                 output_device: torch.device | None) -> None:
        super().__init__()
        #: per chunk: its device and the names of its children, in order
        self.placement: list[tuple[torch.device, list[str]]] = []
        for device, r in zip(devices, chunk_ranges(cuts, len(children))):
            names = []
            for i in r:
                name, child = children[i]
                self.add_module(name, child.to(device))
                names.append(name)
            self.placement.append((device, names))
        self.output_device = output_device

    def device_of(self, name: str) -> torch.device:
        """The device a child runs on."""
        for device, names in self.placement:
            if name in names:
                return device
        raise UsageError(f"Expected a child among {[n for _, ns in self.placement for n in ns]}. Received: {name!r}")

    def forward(self, *args: Any) -> Any:
        x: Any = args
        first = True
        for device, names in self.placement:
            x = map_tensors(x, lambda t, d=device: _move(t, d))
            for name in names:
                module = self._modules[name]
                x = module(*x) if first else module(x)
                first = False
        if self.output_device is not None:
            x = map_tensors(x, lambda t: _move(t, self.output_device))
        return x

    def extra_repr(self) -> str:
        return ", ".join(f"{d}: {names[0]}..{names[-1]}" for d, names in self.placement)


def _move(t: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``t`` on ``device``; asynchronous only towards a GPU.

    A copy to the CPU with ``non_blocking=True`` returns a (pinned) tensor before the
    GPU has written it, and the next CPU layer would read it at once: seen on an H100,
    every element wrong while the GPU lagged. A copy to a GPU is ordered on its stream
    before the kernels that read it, so it may overlap.
    """
    return t.to(device, non_blocking=torch.device(device).type != "cpu")


def place(model: nn.Module, split: str | Sequence[str] = "params",
          devices: Sequence[str | torch.device] = ("cuda:0", "cuda:1"),
          output_device: str | torch.device | None = None) -> PlacedSequential:
    """``model``'s children spread over ``devices``, one run of consecutive children on each.

    Args:
        model: an ``nn.Sequential`` (its forward pass is its children in order).
        split: ``"params"`` (balance the parameter count), or the names of the children
            where the 2nd, 3rd, ... device begins (``"4,8"`` or ``["4", "8"]``).
        devices: one per chunk, e.g. ``["cuda:0", "cuda:1"]``; ``"cpu"`` may repeat.
        output_device: where the output goes (default: stays on the last device).

    Returns:
        A `PlacedSequential` holding ``model``'s own children (moved, not copied).
    """
    children = sequential_children(model, "partrain.nn.place")
    if not devices:
        raise UsageError("Expected at least one device to place the model on. Received: none")
    targets = [_device(d) for d in devices]
    if not isinstance(split, str):
        split = ",".join(split)
    if split == "time":
        raise UsageError("Expected split='params' or child names for partrain.nn.place. Received: 'time' "
                         "(timing needs an example batch; the pipeline strategy measures one)")
    cuts = plan_cuts(children, len(targets), split)
    return PlacedSequential(children, cuts, targets, _device(output_device) if output_device is not None else None)


def _device(spec: str | torch.device) -> torch.device:
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise UsageError(f"Expected a device such as 'cpu' or 'cuda:0'. Received: {spec!r}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index if device.index is not None else torch.cuda.current_device() if count else 0
        if index >= count:
            raise UsageError(f"Expected a device this machine has ({count} CUDA device"
                             f"{'s' * (count != 1)}). Received: {spec!r}")
    return device


__all__ = ["PlacedSequential", "place"]
