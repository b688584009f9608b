"""One DeviceMesh for every axis: data parallel, sharded, tensor parallel and pipeline.

Vocabulary (torchtitan's): a mesh *axis* is one way the processes divide the work, named

- ``dp``: data-parallel replicas: each holds the whole (or its ``fsdp`` group's) model state and
  trains on its own share of every global batch; their gradients are averaged;
- ``fsdp``: sharded data parallel inside a replica: each process holds 1/fsdp of the state and
  trains on its own share of the batch (with ``dp``: HSDP, replicated across ``dp``, sharded
  within ``fsdp``);
- ``tp``: tensor parallel: the processes of a ``tp`` group split each layer's matrices and see the
  same batch;
- ``pp``: pipeline stages: each process of a ``pp`` group holds some of the layers and sees the
  same batch (the first stage its inputs, the last its targets).

A *dimension* is a tensor's (a weight's rows), never an axis. The mesh's dimensions are the axes
of size 2 or more, in the order of `AXES`, outermost first: global rank ``r`` has coordinates
``numpy.unravel_index(r, shape)``, so the processes of one ``tp`` group are neighbours (the axis
that talks most, inside a machine) and ``dp`` spans machines. ``pp`` sits inside ``dp``:
with ``dp`` and ``pp`` alone, rank ``r`` is stage ``r % pp`` of replica ``r // pp``, as
`partrain.strategies.pipeline` has always numbered them.

The mesh is torch's (`torch.distributed.device_mesh.DeviceMesh`), built from process groups made
here with the job's timeout, so every collective along an axis is bounded (``init_device_mesh``
would make them with torch's default of 30 minutes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from . import comm
from .errors import UsageError

#: the axes, outermost first: the order of the mesh's dimensions
AXES = ("dp", "pp", "fsdp", "tp")


@dataclass(frozen=True)
class MeshSpec:
    """How many processes each axis has (1: the axis is not used). Their product is the job's
    number of processes."""

    dp: int = 1
    pp: int = 1
    fsdp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"Expected the mesh axis {f.name} to be a positive integer. "
                                 f"Received: {f.name}={value!r}")

    @classmethod
    def of(cls, parallel: MeshSpec | Mapping[str, Any] | str) -> MeshSpec:
        """A spec from ``{"dp": 2, "tp": 2}``, ``"dp=2,tp=2"`` (the CLI's ``--mesh``) or a spec."""
        if isinstance(parallel, MeshSpec):
            return parallel
        if isinstance(parallel, str):
            parallel = _parse(parallel)
        if not isinstance(parallel, Mapping):
            raise UsageError(f"Expected parallel as a dict of mesh axes ({{'dp': 2, 'tp': 2}}) or 'dp=2,tp=2'. "
                             f"Received: {type(parallel).__name__}")
        unknown = sorted(str(k) for k in parallel if k not in AXES)
        if unknown:
            raise UsageError(f"Expected mesh axes among {', '.join(AXES)}. Received: {', '.join(unknown)}")
        return cls(**dict(parallel))

    @property
    def size(self) -> int:
        """The processes the mesh holds: the product of the axes."""
        return math.prod(getattr(self, axis) for axis in AXES)

    @property
    def data_parallel(self) -> int:
        """Processes that see different shares of a global batch: ``dp * fsdp``."""
        return self.dp * self.fsdp

    def axes(self) -> dict[str, int]:
        """The axes in use (size 2 or more), outermost first."""
        return {axis: getattr(self, axis) for axis in AXES if getattr(self, axis) > 1}

    def __str__(self) -> str:
        return ",".join(f"{axis}={size}" for axis, size in self.axes().items()) or "dp=1"

    def check_workers(self, workers: int) -> None:
        """One line when the axes do not multiply to ``workers`` processes."""
        if self.size != workers:
            product = " x ".join(f"{axis}={size}" for axis, size in self.axes().items()) or "1"
            raise UsageError(f"Expected mesh axes whose product is the number of processes, {workers}. "
                             f"Received: {product} = {self.size}")

    def coordinates(self, rank: int) -> dict[str, int]:
        """Global rank ``rank``'s index along every axis (0 along the unused ones)."""
        out = dict.fromkeys(AXES, 0)
        for axis, size in reversed(self.axes().items()):
            out[axis] = rank % size
            rank //= size
        return out

    def groups(self, *axes: str) -> list[list[int]]:
        """The global ranks of every group along ``axes`` together (processes that differ only in
        their coordinates along ``axes``), each in rank order; the groups in the order of their
        first rank. ``groups("dp", "fsdp")``: the data-parallel groups, one per ``tp`` (and ``pp``)
        coordinate."""
        used = self.axes()
        shape = [used[a] for a in used] or [1]
        ranks = torch.arange(self.size).view(shape)
        along = [i for i, a in enumerate(used) if a in axes]
        other = [i for i in range(len(used)) if i not in along]
        rows = ranks.permute(*other, *along).reshape(-1, math.prod(used[a] for a in used if a in axes))
        return sorted(rows.tolist())


def build_mesh(spec: MeshSpec, device_type: str, *, timeout: float, axes: tuple[str, ...] | None = None) -> Any:
    """The job's DeviceMesh of ``spec`` on ``device_type`` (``cpu``, ``cuda``): one dimension per axis
    in use, or per axis of ``axes`` (size-1 axes among them included: FSDP2's HSDP takes a
    ``("dp", "fsdp")`` mesh with either of size 1), each with groups that time out after ``timeout``
    seconds. Collective: every process of the job calls it, with the same arguments."""
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(a for a in AXES if a in axes) if axes is not None else tuple(spec.axes())
    if axes is not None:
        unused = sorted(a for a in spec.axes() if a not in names)
        if unused:
            raise ValueError(f"build_mesh: the axes {names} leave out {unused} of {spec}")
    shape = [getattr(spec, a) for a in names] or [1]
    names = names or ("dp",)
    me = torch.distributed.get_rank() if comm.is_distributed() else 0
    groups: list[Any] = []
    for axis in names:
        mine = None
        for ranks in spec.groups(axis):  # every process makes every group, in the same order
            group = comm.new_group(ranks, timeout=timeout)
            if me in ranks:
                mine = group
        groups.append(mine)
    layout = torch.arange(spec.size).view(shape)
    return DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=names)


def _parse(text: str) -> dict[str, int]:
    """``"dp=2,tp=2"`` -> ``{"dp": 2, "tp": 2}``."""
    out: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        axis, sep, raw = (s.strip() for s in item.partition("="))
        if not sep or not axis:
            raise UsageError(f"Expected --mesh as AXIS=SIZE,... (e.g. dp=2,tp=2). Received: {text!r}")
        try:
            out[axis] = int(raw)
        except ValueError:
            raise UsageError(f"Expected an integer size for mesh axis {axis}. Received: {axis}={raw!r}") from None
    if not out:
        raise UsageError(f"Expected --mesh as AXIS=SIZE,... (e.g. dp=2,tp=2). Received: {text!r}")
    return out
