"""``mesh``: data parallel, sharded and tensor parallel on one DeviceMesh (`partrain.mesh`).

``fit(..., parallel={"dp": 2, "fsdp": 2, "tp": 2})`` or ``partrain train --mesh dp=2,tp=2``
names how many processes each axis has; `strategy_for` turns that into one strategy:

- one axis: that axis's own strategy (``dp``: ``allreduce``, ``fsdp``: `FullyShard`, ``tp``:
  `TensorParallel`, ``pp``: `Pipeline`);
- ``dp`` and ``pp``: `Pipeline` with ``dp`` replicas, its groups from the mesh;
- any other mix of ``dp``, ``fsdp`` and ``tp``: `MeshParallel`, which composes the two
  strategies torchtitan's way: `TensorParallel` splits the layers over the ``tp`` sub-mesh,
  then `FullyShard` shards the split parameters over the ``("dp", "fsdp")`` sub-mesh - FSDP2's
  HSDP, replicated across ``dp`` and sharded within ``fsdp`` (``fsdp=1``: each ``dp`` replica
  holds everything, DDP's layout; ``dp=1``: plain FSDP). Gradients are reduce-scattered within
  ``fsdp`` and all-reduced across ``dp``, so the step equals one process on the global batch.

Data: ``dp * fsdp`` data-parallel workers, each with its share of every global batch
(``batch_size`` is per data-parallel worker); the ``tp`` processes of one worker see the same
batch. ``pp`` with ``fsdp`` or ``tp`` is not composed yet: one line says so.

Options of the composed parts: ``wrap`` and ``reshard_after_forward`` (`FullyShard`), ``plan``
(`TensorParallel`'s; sequence and loss parallel are not composed).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from .. import comm
from .._compat import dtensor_module
from ..env import DEFAULT_TIMEOUT, DistEnv
from ..errors import UsageError
from ..mesh import MeshSpec, build_mesh
from ..nn.freeze import frozen_mask
from .base import Strategy, get_strategy, register
from .fsdp import FullyShard
from .tensor_parallel import TensorParallel, _whole

#: the options `strategy_for` hands to the strategy it picks, by that strategy's name
PART_OPTIONS = {"fsdp": ("wrap", "reshard_after_forward"), "tp": ("plan",),
                "mesh": ("wrap", "reshard_after_forward", "plan"),
                "pipeline": ("microbatches", "schedule", "split", "virtual_stages")}


def strategy_name(spec: MeshSpec) -> str:
    """The strategy that runs ``spec``: see the module docstring. One line for what is not composed."""
    axes = spec.axes()
    if spec.pp > 1 and (spec.fsdp > 1 or spec.tp > 1):
        raise UsageError(f"Expected pp with dp alone (pipeline stages are not yet composed with fsdp or tp). "
                         f"Received: mesh {spec}")
    if spec.pp > 1:
        return "pipeline"
    if len(axes) > 1:
        return "mesh"
    return {"dp": "allreduce", "fsdp": "fsdp", "tp": "tp"}.get(next(iter(axes), "dp"), "allreduce")


def strategy_for(parallel: MeshSpec | Mapping[str, Any] | str, **options: Any) -> Strategy:
    """The strategy for the mesh ``parallel`` (``{"dp": 2, "tp": 2}``, ``"dp=2,tp=2"``), with
    ``options`` of the part it picks (`PART_OPTIONS`). Checks the spec, not the process count."""
    spec = MeshSpec.of(parallel)
    name = strategy_name(spec)
    allowed = PART_OPTIONS.get(name, ())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise UsageError(f"Expected options of a {name} mesh ({spec}) among {list(allowed) or '(none)'}. "
                         f"Received: {', '.join(unknown)}")
    if name == "mesh":
        return MeshParallel(dp=spec.dp, fsdp=spec.fsdp, tp=spec.tp, **options)
    if name == "pipeline":
        return get_strategy("pipeline", stages=spec.pp, **options)
    return get_strategy(name, **options)


def mesh_strategy(parallel: MeshSpec | Mapping[str, Any] | str, strategy: Strategy | str = "mesh") -> Strategy:
    """`fit`'s ``parallel=``: the strategy of the mesh. ``strategy`` is `fit`'s own argument, which
    must leave the choice to the mesh (``"allreduce"``, its default, or ``"mesh"``)."""
    if isinstance(strategy, Strategy) or strategy not in ("allreduce", "mesh"):
        shown = strategy.name if isinstance(strategy, Strategy) else strategy
        raise UsageError(f"Expected either strategy or parallel (the mesh picks the strategy; options go in "
                         f"strategy=MeshParallel(...)). Received: strategy={shown!r} and parallel={parallel!r}")
    return strategy_for(parallel)


@register
class MeshParallel(Strategy):
    """Tensor parallel inside sharded data parallel inside data-parallel replicas, on one mesh."""

    name = "mesh"
    checkpoints_within_epoch = True
    averages_gradients = True
    #: each process writes its own shards and slices (`partrain.sharded_checkpoint`): no process
    #: gathers the whole model; any mesh, process count or strategy reads them back
    sharded_checkpoints = True
    holds_part_of_model = True

    def __init__(self, dp: int = 1, fsdp: int = 1, tp: int = 1, wrap: str = "auto",
                 reshard_after_forward: bool = True, plan: str = "auto") -> None:
        super().__init__()
        self.spec = MeshSpec(dp=dp, fsdp=fsdp, tp=tp)
        if self.spec.data_parallel < 2:
            raise UsageError(f"Expected dp * fsdp of at least 2 for strategy 'mesh' (tensor parallel alone is "
                             f"strategy 'tp'). Received: dp={dp}, fsdp={fsdp}")
        self.dp, self.fsdp, self.tp = dp, fsdp, tp
        self.wrap, self.reshard_after_forward, self.plan = wrap, reshard_after_forward, plan
        self._fsdp = FullyShard(wrap=wrap, reshard_after_forward=reshard_after_forward)
        self._tp = TensorParallel(plan=plan) if tp > 1 else None
        self.mesh: Any = None
        self._dp_group: Any = None  # this process's data-parallel group (the world without tp)
        self._tp_ranks: list[int] = [0]
        self._names: dict[int, str] = {}  # the prepared model's parameters' names, by id

    # ----- topology -------------------------------------------------------------------
    def extra_processes(self, workers: int) -> int:
        """None; asked before any process starts: the mesh must hold exactly the job's processes."""
        self.spec.check_workers(workers)
        return 0

    def data_parallel_workers(self, workers: int) -> int:
        return self.spec.data_parallel

    def describe_rank(self, rank: int, world_size: int) -> str | None:
        """``rank 3 (dp 0, fsdp 1, tp 1)``: its coordinates along the axes in use."""
        at = self.spec.coordinates(rank)
        return f"rank {rank} ({', '.join(f'{axis} {at[axis]}' for axis in self.spec.axes())})"

    def check_model(self, model: nn.Module, workers: int) -> None:
        """The mesh against the job and the model: the processes, the sharding units, the tensor-parallel
        plan for ``tp`` processes (heads that divide), no frozen slices with ``tp``."""
        self.spec.check_workers(workers)
        self._fsdp.check_model(model, self.spec.data_parallel)
        if self._tp is not None:
            self._tp.check_model(model, self.tp)

    def setup(self, env: DistEnv, *, store: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().setup(env, store=store, timeout=timeout)
        self.spec.check_workers(env.world_size)
        axes = ("dp", "fsdp", "tp") if self._tp is not None else ("dp", "fsdp")
        self.mesh = build_mesh(self.spec, env.device.type, timeout=timeout, axes=axes)
        self._fsdp.setup(env, store=store, timeout=timeout, mesh=self.mesh["dp", "fsdp"])
        if self._tp is not None:
            self._tp.setup(env, store=store, timeout=timeout, mesh=self.mesh["tp"])
            self._dp_group = self.mesh_group(("dp", "fsdp"), timeout)
            self._tp_ranks = next(r for r in self.spec.groups("tp") if env.rank in r)
            # full_tensor of a parameter sharded over fsdp and tp gathers twice, and torch says so per tensor
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    def mesh_group(self, axes: tuple[str, ...], timeout: float) -> Any:
        """This process's group along ``axes`` together (every process makes every group)."""
        mine = None
        for ranks in self.spec.groups(*axes):
            group = comm.new_group(ranks, timeout=timeout)
            if self.env.rank in ranks:
                mine = group
        return mine

    @property
    def num_workers(self) -> int:
        return self.spec.data_parallel

    @property
    def rank(self) -> int:
        """This process's data-parallel worker: ``dp`` and ``fsdp`` coordinates (its ``tp`` peers share it)."""
        at = self.spec.coordinates(self.env.rank)
        return at["dp"] * self.fsdp + at["fsdp"]

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def comm_bytes(self) -> int:  # type: ignore[override]
        """What this process put into collectives: the sharding's and the split's."""
        return self._fsdp.comm_bytes + (self._tp.comm_bytes if self._tp is not None else 0)

    @comm_bytes.setter
    def comm_bytes(self, value: int) -> None:  # Strategy.__init__ starts the count at 0
        if hasattr(self, "_fsdp"):
            self._fsdp.comm_bytes = value
            if self._tp is not None:
                self._tp.comm_bytes = 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the data-parallel workers, as the first ``tp`` process of each holds it, on
        every process (the ``tp`` processes of a worker compute the same figures, their clocks aside)."""
        if not comm.is_distributed():
            return tensor
        comm.all_reduce_sum(tensor, self._dp_group)
        if self._tp is not None:
            comm.broadcast_into(tensor, self._tp_ranks[0], self.mesh.get_group("tp"))
        return tensor

    def barrier(self) -> None:
        comm.barrier(None)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src`` is a data-parallel worker: its first ``tp`` process sends."""
        return comm.broadcast_object(obj, src * self.tp, None)

    # ----- the training loop's side -------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        """Split ``model`` over ``tp`` (`TensorParallel`), then shard it over ``("dp", "fsdp")``
        (`FullyShard`); returns the model and the `ShardedOptimizer` stepping this process's part."""
        if optimizer.state:
            raise UsageError("Expected an optimizer that has not stepped yet for strategy 'mesh' (its state is "
                             f"rebuilt on the shards). Received: state for {len(optimizer.state)} parameters")
        if self._tp is not None:
            frozen = [n for n, p in model.named_parameters() if frozen_mask(p) is not None]
            if frozen:
                raise UsageError(f"Expected no frozen slices with a tp axis (their masks are of the whole tensors). "
                                 f"Received: frozen elements in {', '.join(frozen[:4])}")
            model, optimizer = super().prepare(model, optimizer)  # on the device
            # one model everywhere before it is split: global rank 0's (tp's split scatters within tp only)
            comm.broadcast_tensors([p.data for p in model.parameters()] + list(model.buffers()), src=0)
            model, optimizer = self._tp.prepare(model, optimizer)
            for hook in self._tp.optimizer_hooks:  # fsdp's state dict gathers the split tensors itself
                hook.remove()
            # a split layer returns its DTensor output's local tensor, a view; FSDP2 warns that an in-place
            # op on it would skip its hook: the loop does none
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                                    category=UserWarning)
        model, optimizer = self._fsdp.prepare(model, optimizer)
        self._names = {id(p): name for name, p in model.named_parameters()}
        if self._tp is not None:  # whole optimizer states in the model's order of a fused layer's rows
            optimizer.register_state_dict_post_hook(functools.partial(self._reorder, model, split=False))
            optimizer.register_load_state_dict_pre_hook(functools.partial(self._reorder, model, split=True))
        return model, optimizer

    def _reorder(self, model: nn.Module, optimizer: Optimizer, state_dict: dict[str, Any], *,
                 split: bool) -> dict[str, Any]:
        """A whole optimizer state (numbered as one process's) with every tensor in the model's own
        order (``split``: in the split layout's, before it is loaded): `TensorParallel.model_order`."""
        if not state_dict:  # the gathered state is worker 0's; the others' is empty
            return state_dict
        by_id = {id(p): name for name, p in model.named_parameters()}
        names = [by_id[id(p)] for group in optimizer.param_groups for p in group["params"]]
        assert self._tp is not None
        state = {index: {key: self._tp.model_order(names[int(index)], value, split=split)
                         for key, value in entry.items()}
                 for index, entry in state_dict["state"].items()}
        return {**state_dict, "state": state}

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        with self._fsdp.no_sync(model):
            yield

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model in plain tensors (collective: every process calls it); with ``tp`` on every
        process, else on worker 0 (the others get an empty dict)."""
        if self._tp is not None:
            return self._tp.model_state_dict(model)
        return self._fsdp.model_state_dict(model)

    def metrics(self) -> dict[str, float]:
        return self._fsdp.metrics()

    def grad_norm(self, params: Any) -> torch.Tensor:
        return self._fsdp.grad_norm(params)

    def clip_grad_norm_(self, params: Any, max_norm: float) -> torch.Tensor:
        return self._fsdp.clip_grad_norm_(params, max_norm)

    def checkpoint_layout(self, param: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                               Callable[[torch.Tensor], torch.Tensor]] | None:
        """As under ``tp``: a fused layer's parameter (q, k, v in one matrix, held in the split's
        order) is saved whole in the model's own order, so that another tp reads it back; every
        other tensor as it is laid out, each process writing its own pieces."""
        name = self._names.get(id(param))
        if self._tp is None or name is None or not self._tp.is_fused(name):
            return None
        tp = self._tp

        def to_saved(value: torch.Tensor) -> torch.Tensor:
            return tp.model_order(name, _whole(value))

        def from_saved(whole: torch.Tensor) -> torch.Tensor:
            split = tp.model_order(name, whole, split=True).to(param.device)
            placed: Any = param
            return dtensor_module().distribute_tensor(split, placed.device_mesh, placed.placements)

        return to_saved, from_saved

    def state_dict(self) -> dict[str, Any]:
        return {"mesh": str(self.spec)}


__all__ = ["PART_OPTIONS", "MeshParallel", "mesh_strategy", "strategy_for", "strategy_name"]
