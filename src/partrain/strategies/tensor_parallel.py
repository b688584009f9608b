"""``tp``: tensor parallel, each layer's matrices split over the processes (DTensor).

Every process holds a slice of each split matrix and sees the **same batch**: the split is of
the model, not of the data. A transformer block's attention splits by heads (q, k, v by output
features, "colwise"; the output projection by input features, "rowwise") and its MLP by hidden
units (up colwise, down rowwise), so that each block costs two all-reduces of its activations
in the forward pass and two in the backward pass (Megatron-LM's split). The splitting itself is
torch's: `torch.distributed.tensor.parallel.parallelize_module` over a one-dimensional
`DeviceMesh` of every worker, with the plans of `partrain.strategies._tp_plan` (automatic for
the built-in GPT, Llama-style Hugging Face decoders, GPT-2 and Sequential MLPs, or the user's
``plan="PATTERN=STYLE,..."``).

What the strategy adds around torch's API:

- one data-parallel worker: every process gets the whole global batch (``num_workers`` is 1,
  ``rank`` 0), and the loop's sums are worker 0's, sent to all (they agree anyway);
- a fused q, k, v projection is split part by part (each process gets its heads of q, of k and
  of v: the rows are reordered before the split and back in every state dict), and attention
  modules are set to their local head count;
- tied parameters (the GPT's embedding and output layer) stay one parameter;
- the optimizer built on the whole model is kept, with the split parameters in its groups
  (its hyperparameters, hooks and class unchanged); its ``state_dict()`` holds whole tensors
  and ``load_state_dict()`` takes whole tensors (a checkpoint of any strategy);
- gradient clipping and the NaN policy use the whole model's gradient norm (one all-reduce);
- ``model_state_dict`` holds the whole model in plain tensors, which ``single``, every other
  strategy and ``partrain serve`` load; `fit`'s checkpoints are sharded (each process writes
  its slices, `partrain.sharded_checkpoint`; a fused layer whole, in its own order:
  `checkpoint_layout`) and exported in that whole form at the run's end;
- optional sequence parallel (norms on each process's share of the positions: the all-reduces
  become all-gathers and reduce-scatters) and loss parallel (the output layer's logits stay
  split by vocabulary into the loss).

Vocabulary: *tp* is the number of processes a layer is split over (the mesh's only axis, named
``"tp"``); a *split* matrix is a DTensor sharded over it; the *local* part is this process's slice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from .. import comm
from .._compat import dtensor_module
from ..env import DEFAULT_TIMEOUT, DistEnv
from ..errors import UsageError
from ..memory import local_tensor
from ..nn.freeze import frozen_mask
from . import _tp_plan as plans
from ._tp_styles import conv1d_style, first_input_style
from .base import LossFn, StepPlan, Strategy, clip_with_norm_, detach, register


@register
class TensorParallel(Strategy):
    """Tensor parallel over every worker. ``plan``: ``"auto"`` or ``"PATTERN=STYLE,..."`` (the styles
    of `partrain.strategies._tp_plan`); ``sequence_parallel``: between the blocks, each process keeps
    its share of the positions (norms, residuals); ``loss_parallel``: the loss reads the logits split
    by vocabulary. Both options need ``plan="auto"``."""

    name = "tp"
    checkpoints_within_epoch = True
    #: each process writes its own slices (`partrain.sharded_checkpoint`)
    sharded_checkpoints = True
    holds_part_of_model = True

    def __init__(self, plan: str = "auto", sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
        super().__init__()
        for key, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
            if not isinstance(value, bool):
                raise UsageError(f"Expected {key} to be true or false. Received: {key}={value!r}")
        if not isinstance(plan, str) or not plan.strip():
            raise UsageError(f"Expected plan='auto' or 'PATTERN=STYLE,...'. Received: plan={plan!r}")
        self.plan = plan.strip()
        if self.plan != "auto":
            plans.parse_plan(self.plan)  # its syntax: one line now, before any process starts
            for key, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
                if value:
                    raise UsageError(f"Expected {key} with plan='auto' (it places the layouts the automatic plans "
                                     f"know: the built-in GPT, Llama-style decoders). Received: {key}=True with "
                                     f"plan={self.plan!r}")
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.tp = 1
        self.mesh: Any = None
        #: fused parameters by name: (the dim their parts are side by side in, the parts)
        self._fused: dict[str, tuple[int, int]] = {}
        self._fused_ids: dict[int, tuple[int, int]] = {}
        self._loss_parallel_now = False
        self._param_bytes = 0
        self._param_bytes_whole = 0
        #: the optimizer's state-dict hooks (whole tensors out, split ones in); a strategy that gathers the
        #: state itself (fsdp on top, `partrain.strategies.mesh`) removes them
        self.optimizer_hooks: list[Any] = []

    # ----- topology -------------------------------------------------------------------
    def data_parallel_workers(self, workers: int) -> int:
        """One: every process trains on the same batches (the split is of the model)."""
        return 1

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        """0 on every process: the data and the loop's seeds are the same everywhere."""
        return 0 if self.env.rank in self.worker_ranks else -1

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def setup(self, env: DistEnv, *, store: Any = None, timeout: float = DEFAULT_TIMEOUT, mesh: Any = None) -> None:
        """``mesh``: a 1-D DeviceMesh to split over (a composed run's ``"tp"`` sub-mesh); None: every
        process."""
        super().setup(env, store=store, timeout=timeout)
        self.tp = env.world_size if mesh is None else mesh.size()
        if mesh is not None:
            self.mesh = mesh
        elif comm.is_distributed() and self.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(env.device.type, (self.tp,), mesh_dim_names=("tp",))

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Worker 0's ``tensor`` on every process: one data-parallel worker, whose figures every
        process computes alike (its clock decides where they do not)."""
        if comm.is_distributed() and self.tp > 1:
            staged = tensor.to(self.device) if self.env.backend == "nccl" else tensor
            dist.broadcast(staged, src=0)
            if staged is not tensor:
                tensor.copy_(staged)
        return tensor

    # ----- the plan -------------------------------------------------------------------
    def check_model(self, model: nn.Module, workers: int) -> None:
        """The plan for ``workers`` processes, checked on the caller's model before any starts."""
        self._plan_for(model, workers)

    def _plan_for(self, model: nn.Module, tp: int) -> plans.AutoPlan:
        if self.plan == "auto":
            found = plans.auto_plan(model, self.sequence_parallel)
            if self.loss_parallel and found.head is None:
                raise UsageError(f"Expected loss_parallel with a language model whose output layer tp splits by "
                                 f"vocabulary (the built-in GPT, a Llama-style decoder). Received: "
                                 f"{type(model).__name__}, split as {found.family}")
        else:
            plan = plans.user_plan(model, self.plan)
            found = plans.AutoPlan(plan, "user", None, plans.user_attention(model, plan))
        plans.check_plan(model, found.plan, found.attention, tp)
        return found

    # ----- prepare: split the model, keep the optimizer -------------------------------
    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        """``model`` with its planned layers split over the processes, and ``optimizer`` (the same
        object) stepping the split parameters."""
        model, optimizer = super().prepare(model, optimizer)
        found = self._plan_for(model, self.tp)
        frozen = [n for n, p in model.named_parameters() if frozen_mask(p) is not None]
        if frozen:
            raise UsageError(f"Expected no frozen slices with strategy 'tp' (their masks are of the whole "
                             f"tensors). Received: frozen elements in {', '.join(frozen[:4])}")
        self._param_bytes_whole = sum(p.numel() * p.element_size() for p in model.parameters())
        if self.mesh is None:  # one process: nothing to split
            self._param_bytes = self._param_bytes_whole
            return model, optimizer
        from torch.distributed.tensor.parallel import parallelize_module

        before = dict(model.named_parameters(remove_duplicate=False))
        ties = _tied_names(before)
        modules = dict(model.named_modules())
        for name, parts in plans.with_parts(found.plan).items():
            self._fuse(name, modules[name], parts)
        for name in found.attention:
            for attr in plans.LOCAL_COUNTS:
                value = getattr(modules[name], attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(modules[name], attr, value // self.tp)
        styles = {name: self._style(split, modules[name], name == found.head) for name, split in found.plan.items()}
        parallelize_module(model, self.mesh, styles)
        _retie(model, ties)
        _broadcast_replicated(model)
        after = dict(model.named_parameters(remove_duplicate=False))
        self._fused_ids = {id(after[n]): v for n, v in self._fused.items() if n in after}
        _swap_parameters(optimizer, {id(before[n]): after[n] for n in before}, self._shard_like)
        self.optimizer_hooks = [optimizer.register_state_dict_post_hook(self._whole_optimizer_state),
                                optimizer.register_load_state_dict_pre_hook(self._split_optimizer_state)]
        self._count_communication(model, found.plan, modules)
        if found.head is not None and self.loss_parallel:
            modules[found.head].register_forward_hook(self._head_output)
        self._param_bytes = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
        return model, optimizer

    def _style(self, split: plans.Split, module: nn.Module, head: bool) -> Any:
        """torch's ParallelStyle for one planned module."""
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
        )

        Replicate, Shard = dtensor_module().Replicate, dtensor_module().Shard
        seq = Shard(1) if split.sequence else Replicate()
        if plans.is_conv1d(module):
            return conv1d_style(split.style, gather=split.style == "colwise_gather")
        if split.style == "colwise":
            return ColwiseParallel(input_layouts=seq)
        if split.style == "colwise_gather":
            if head and self.loss_parallel:  # the logits stay split by vocabulary into the loss
                return ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
            return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        if split.style == "rowwise":
            if isinstance(module, nn.Embedding):
                return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
            return RowwiseParallel(output_layouts=seq)
        if split.style == "norm":
            return SequenceParallel()
        if split.style == "gather_sequence":
            return first_input_style(Shard(1), Replicate(), local=False)
        return first_input_style(Replicate(), Shard(1), local=True)  # split_sequence

    def _fuse(self, name: str, module: nn.Module, parts: int) -> None:
        """Reorder a fused layer's output features so that torch's even split gives each process its
        slice of every part: ``[q, k, v]`` -> ``[q0, k0, v0, q1, k1, v1]`` (a Conv1D's weight holds
        them in dim 1)."""
        with torch.no_grad():
            for pname, param in module.named_parameters(recurse=False):
                dim = 1 if plans.is_conv1d(module) and param.dim() == 2 else 0
                param.copy_(param.index_select(dim, _fused_order(param.shape[dim], parts, self.tp)))
                self._fused[f"{name}.{pname}"] = (dim, parts)

    # ----- one training step ------------------------------------------------------------
    def train_step(self, model: nn.Module, optimizer: Optimizer, x: Any, y: Any,
                   plan: StepPlan | LossFn, **options: Any) -> tuple[Any, torch.Tensor]:
        """`Strategy.train_step` on the split model: the same batch on every process; under loss
        parallel the loss reads the logits split by vocabulary. Returns whole, plain tensors."""
        plan = StepPlan.of(plan, **options)
        with self._loss_parallel_step():
            out = plan.forward_fn(model, x) if plan.forward_fn is not None else model(x)
            per_sample = plan.loss_fn(out, y)
            (per_sample.sum() * plan.loss_scale).backward()
        if plan.update:
            self._settle_gradients(model)
            if plan.before_update is not None and not plan.before_update():
                optimizer.zero_grad(set_to_none=True)
            self.optimizer_step(optimizer)
        return _whole_tree(detach(out)), _whole(per_sample.detach())

    @contextlib.contextmanager
    def _loss_parallel_step(self) -> Iterator[None]:
        if not (self.loss_parallel and self.mesh is not None):
            yield
            return
        from torch.distributed.tensor.parallel import loss_parallel

        self._loss_parallel_now = True
        try:
            with loss_parallel():
                yield
        finally:
            self._loss_parallel_now = False

    def _head_output(self, module: nn.Module, args: Any, output: Any) -> Any:
        """The output layer's logits: split by vocabulary inside a loss-parallel step, else whole
        (evaluation, a script's own forward pass)."""
        return output if self._loss_parallel_now else output.full_tensor()

    def _settle_gradients(self, model: nn.Module) -> None:
        """Gradients left as partial sums (a sequence-parallel norm's weight: each process summed
        over its positions) are summed over the processes, as their parameters are laid out."""
        DTensor = dtensor_module().DTensor
        for p in model.parameters():
            g = p.grad
            if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                self.comm_bytes += 2 * g.numel() * g.element_size() * (self.tp - 1) // self.tp  # an all-reduce
                p.grad = g.redistribute(p.device_mesh, p.placements)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    # ----- gradients between the exchange and the step -----------------------------------
    def grad_norm(self, params: Any) -> torch.Tensor:
        """The whole model's gradient 2-norm: split gradients summed over the processes (one
        all-reduce of one number), whole ones counted once."""
        DTensor, Shard = dtensor_module().DTensor, dtensor_module().Shard
        split = torch.zeros((), dtype=torch.float64, device=self.device)
        whole = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in params:
            g = p.grad
            if g is None:
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            square = torch.linalg.vector_norm(local.detach(), dtype=torch.float64) ** 2
            if isinstance(g, DTensor) and any(isinstance(pl, Shard) for pl in g.placements):
                split = split + square
            else:
                whole = whole + square
        if self.mesh is not None:
            split = split.reshape(1)
            dist.all_reduce(split)
            split = split[0]
        return (split + whole).sqrt()

    def clip_grad_norm_(self, params: Any, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` by the whole model's norm (see `grad_norm`)."""
        params = list(params)
        return clip_with_norm_(params, max_norm, self.grad_norm(params))

    # ----- checkpoints --------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model in plain tensors, the fused layers in their own order (every process
        must call it: the split tensors are gathered)."""
        state = {}
        for name, value in model.state_dict().items():
            value = _whole(value)
            if name in self._fused:
                dim, parts = self._fused[name]
                value = value.index_select(dim, _fused_order(value.shape[dim], parts, self.tp).argsort())
            state[name] = value
        return state

    def is_fused(self, name: str) -> bool:
        """Parameter ``name`` is a fused layer's (q, k, v in one matrix), held in the split's order."""
        return name in self._fused

    def model_order(self, name: str, value: Any, *, split: bool = False) -> Any:
        """``value``, whole and shaped like parameter ``name``, from the split layout's order to the
        model's own (``split=True``: back). A fused layer's parts (q, k, v) are held interleaved, each
        process's slices side by side, while split (`_fuse`); any other value is returned as it is.
        For a strategy composing tp with another that gathers the tensors (`partrain.strategies.mesh`)."""
        if name not in self._fused or not isinstance(value, torch.Tensor):
            return value
        dim, parts = self._fused[name]
        if value.dim() <= dim:
            return value
        order = _fused_order(value.shape[dim], parts, self.tp)
        return value.index_select(dim, order if split else order.argsort())

    def _whole_optimizer_state(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``optimizer.state_dict()`` in whole, plain tensors (collective: every process calls it)."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        whole = {}
        for index, entry in state_dict["state"].items():
            param = params[index]
            whole[index] = {k: self._whole_like(param, v) for k, v in entry.items()}
        return {**state_dict, "state": whole}

    def _whole_like(self, param: torch.Tensor, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        value = _whole(value)
        if id(param) in self._fused_ids and value.shape == param.shape:
            dim, parts = self._fused_ids[id(param)]
            value = value.index_select(dim, _fused_order(value.shape[dim], parts, self.tp).argsort())
        return value

    def _split_optimizer_state(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A whole optimizer state (a checkpoint's, of any strategy) split as the parameters are."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        split = {}
        for index, entry in state_dict["state"].items():
            param = params[int(index)]
            split[index] = {k: self._shard_like(param, v) for k, v in entry.items()}
        return {**state_dict, "state": split}

    def _shard_like(self, param: torch.Tensor, value: Any) -> Any:
        """``value`` (whole, shaped like ``param``) split as ``param`` is; anything else as it is."""
        dt = dtensor_module()
        if not isinstance(param, dt.DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, dt.DTensor) \
                or tuple(value.shape) != tuple(param.shape):
            return value
        if id(param) in self._fused_ids:
            dim, parts = self._fused_ids[id(param)]
            value = value.index_select(dim, _fused_order(value.shape[dim], parts, self.tp))
        return dt.distribute_tensor(value.to(param.device), param.device_mesh, param.placements)

    def checkpoint_layout(self, param: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                               Callable[[torch.Tensor], torch.Tensor]] | None:
        """A fused layer's parameter is saved whole in its own order (its split order depends on
        ``tp``: another split reads it back), everything else as its slices."""
        if id(param) not in self._fused_ids:
            return None
        return (functools.partial(self._whole_like, param), functools.partial(self._shard_like, param))

    def state_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "plan": self.plan}

    def metrics(self) -> dict[str, float]:
        """``param_bytes``: the parameters this process holds (its slices of the split ones, whole
        ones whole); ``param_share``: that over the whole model's."""
        share = self._param_bytes / self._param_bytes_whole if self._param_bytes_whole else 1.0
        return {"param_bytes": float(self._param_bytes), "param_share": share}

    # ----- communication counted at the split layers' boundaries -------------------------
    def _count_communication(self, model: nn.Module, plan: plans.Plan, modules: dict[str, nn.Module]) -> None:
        """``comm_bytes``: what the split's collectives send from this process, as a ring sends
        them: an all-reduce of B bytes 2(tp-1)/tp B, an all-gather or a reduce-scatter (tp-1)/tp B;
        forward, and the same again backward when training (each collective's mirror image)."""
        for name, split in plan.items():
            if split.style == "rowwise":  # the partial outputs summed: an all-reduce, or reduce-scatter
                modules[name].register_forward_hook(
                    functools.partial(self._count_output, ring=1 + (not split.sequence), part=split.sequence))
            elif split.style in ("colwise_gather", "gather_sequence"):  # gathered: an all-gather
                modules[name].register_forward_hook(functools.partial(self._count_output, ring=1, part=False))
            if split.style.startswith("colwise") and split.sequence:  # its input's positions gathered
                modules[name].register_forward_pre_hook(self._count_input)

    def _count_output(self, module: nn.Module, args: Any, output: Any, ring: int, part: bool) -> None:
        self._count(output, ring, part)

    def _count_input(self, module: nn.Module, args: Any) -> None:
        if args:
            self._count(args[0], 1, part=True)

    def _count(self, t: Any, ring: int, part: bool) -> None:
        """``ring`` times (tp-1)/tp of ``t``'s whole bytes (``part``: a plain ``t`` is this process's
        share of the positions, one of tp), twice when the backward pass will mirror it."""
        t = t[0] if isinstance(t, tuple) else t
        if not isinstance(t, torch.Tensor):
            return
        numel = t.numel() * (self.tp if part and not isinstance(t, dtensor_module().DTensor) else 1)
        passes = 2 if torch.is_grad_enabled() else 1
        self.comm_bytes += ring * passes * numel * t.element_size() * (self.tp - 1) // self.tp


def _whole(t: Any) -> Any:
    """A DTensor gathered whole (collective); anything else as it is."""
    return t.full_tensor() if isinstance(t, dtensor_module().DTensor) else t


def _whole_tree(obj: Any) -> Any:
    from .._tree import map_tensors

    return map_tensors(obj, _whole)


def _fused_order(size: int, parts: int, tp: int) -> torch.Tensor:
    """Indices that put the ``tp`` slices of each of ``parts`` side-by-side blocks next to each other:
    ``[p0 | p1 | p2]`` -> ``[p0_0, p1_0, p2_0, p0_1, p1_1, p2_1, ...]`` (slice ``r`` of every part)."""
    return torch.arange(size).view(parts, tp, size // (parts * tp)).transpose(0, 1).reshape(-1)


def _tied_names(named: dict[str, nn.Parameter]) -> list[list[str]]:
    """Groups of names that share one Parameter (a tied embedding and output layer)."""
    by_id: dict[int, list[str]] = {}
    for name, p in named.items():
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Every name of a tied group set to the first one's (split) Parameter again: torch split each
    module's copy on its own. Both uses must have split it alike."""
    for names in ties:
        first = model.get_parameter(names[0])
        for other in names[1:]:
            module_name, _, attr = other.rpartition(".")
            module = model.get_submodule(module_name)
            current = getattr(module, attr)
            if getattr(current, "placements", None) != getattr(first, "placements", None):
                raise UsageError(f"Expected the tied parameters {names[0]!r} and {other!r} split alike by the plan. "
                                 f"Received: {getattr(first, 'placements', 'whole')} and "
                                 f"{getattr(current, 'placements', 'whole')}")
            setattr(module, attr, first)


def _broadcast_replicated(model: nn.Module) -> None:
    """The parameters and buffers every process holds whole, worker 0's on every process (as DDP's
    first broadcast: a model_fn that is not deterministic still trains one model)."""
    DTensor = dtensor_module().DTensor
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if not isinstance(t, DTensor):
            by_dtype.setdefault(t.dtype, []).append(t)
    for tensors in by_dtype.values():
        comm.broadcast_tensors(tensors, src=0)


def _swap_parameters(optimizer: Optimizer, new: dict[int, nn.Parameter],
                     shard: Callable[[torch.Tensor, Any], Any]) -> None:
    """``optimizer`` stepping the split parameters in place of the whole ones: the same groups,
    hyperparameters and hooks; any state it already holds split alike."""
    state = optimizer.state
    for group in optimizer.param_groups:
        swapped = []
        for p in group["params"]:
            q = new.get(id(p), p)
            if q is not p and p in state:
                state[q] = {k: shard(q, v) for k, v in state.pop(p).items()}
            swapped.append(q)
        group["params"] = swapped

