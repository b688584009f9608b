"""``fsdp``: sharded data parallel on FSDP2 (``torch.distributed.fsdp.fully_shard``).

As under ``allreduce`` every worker computes gradients on its share of the global batch and
every worker takes the same step; unlike it no worker holds the whole model. Every
parameter, its gradient and its optimizer state are cut into ``num_workers`` pieces along
their first dimension (ZeRO-3, Rajbhandari et al., 2020): worker ``r`` keeps piece ``r`` and
steps only that. Before a sharding unit runs its forward its parameters are all-gathered;
after its backward its gradients are reduce-scattered - averaged over the workers as DDP's
all-reduce averages them, each worker receiving its piece. So training equals one process on
the global batch, as ``allreduce`` does, with about ``1/num_workers`` of the memory for the
model's persistent state.

Vocabulary: a *unit* is a module handed to ``fully_shard`` (its parameters are gathered in
one collective, and dropped again after its forward with ``reshard_after_forward``); the
*root* is the whole model, the last unit, holding what no other unit holds. A *shard* is one
worker's piece of a parameter (the local tensor of its DTensor).

Options (``--strategy-opt key=value``, or ``FullyShard(...)`` / ``get_strategy("fsdp", ...)``
as the ``strategy`` of `fit`):

- ``wrap``: the units. ``auto``: the model's repeated blocks (a ``ModuleList`` or
  ``Sequential`` of two or more modules of one class: a GPT's blocks, Hugging Face's
  ``model.layers``), else its top-level children that hold parameters; ``root``: the root only;
  or class names, ``wrap="Block,MLP"`` (nested ones are sharded inside out). Then the root.
- ``reshard_after_forward``: True (ZeRO-3) drops a unit's gathered parameters after its
  forward and gathers them again for its backward; False (ZeRO-2) keeps them until the
  backward is done: one all-gather less per step, the gathered parameters held in between.
- ``param_dtype`` / ``reduce_dtype`` (``bfloat16``, ``float16``, ``float32``, ``float64``):
  FSDP2's ``MixedPrecisionPolicy``: the forward and backward run on parameters gathered in
  ``param_dtype``, gradients are reduced in ``reduce_dtype`` (default: ``param_dtype``); the
  shards, the optimizer state and the step stay in the parameters' own dtype.
- ``offload``: FSDP2's ``CPUOffloadPolicy`` on CUDA (shards, gradients and optimizer state in
  host memory, the step on the CPU). On CPU a no-op: everything already lives in host memory.

Building: no worker builds the whole model. `build_model` (which `fit` calls) builds each
parameter as this worker's rows only, with the values a whole build from the same seed gives
them (`partrain.nn.partial.build_shards`); `prepare` shards the meta model and copies the rows
in. What the rows cannot follow (``orthogonal_``, a write into part of a parameter, frozen
slices set in ``model_fn``) is built whole and broadcast from worker 0, as before.

The optimizer: `prepare` takes the user's optimizer as built on the model's parameters
(before any step: it refuses one with state) and points its parameter groups at the
sharded parameters in place (same object, same groups and settings, so schedulers, the
loop's learning-rate schedule and ``scale_lr`` see what they set), then returns it inside a
`ShardedOptimizer`: its steps update this worker's shards, and its ``state_dict()`` is
the whole model's, as one process's optimizer numbers it (collective: worker 0 receives it,
the others an empty dict), so that checkpoints of ``fsdp``, ``allreduce`` and ``single`` load
under each other, with any number of workers.

Checkpoints and the final model: `model_state_dict` gathers the full parameters on worker 0
(plain CPU tensors; the others get an empty dict) with
``torch.distributed.checkpoint.state_dict.get_model_state_dict``: ``single``, ``partrain
serve`` and any other strategy load it. Resume loads the whole-model checkpoint in every
worker before the model is sharded, and the optimizer's whole-model state into the shards.
`fit`'s own checkpoints are sharded instead (``sharded_checkpoints``: every worker writes and
reads its own shards, `partrain.sharded_checkpoint`); the whole-model form is what a resume
from a one-file checkpoint reads and what the run's end exports.

Frozen slices (`partrain.nn.freeze`) stay exact: their masks move onto the sharded
parameters (checkpoints keep them), and each step of the `ShardedOptimizer` holds the frozen
elements of this worker's shards and of their optimizer state, as `keep_frozen` does for
whole tensors. Gradient clipping and ``on_nan="skip"`` use the whole model's gradient norm
(one all-reduce), with frozen elements' gradients zeroed first. SyncBatchNorm
(`partrain.nn.SyncBatchNorm`) works as under ``allreduce``. Plain BatchNorm's running
statistics are each worker's own (buffers are not sharded); checkpoints hold worker 0's.

One worker: nothing to shard; the model trains unwrapped, as under ``single``, and mixed
precision is refused (use `fit`'s ``precision="bf16"``).

Measured: ``comm_bytes`` counts, per worker, the bytes of the collectives in
all-reduce-equivalent bytes, so that it compares with ``allreduce``'s: an all-gather or a
reduce-scatter of ``S`` bytes (the unsharded size) moves half the bytes of an all-reduce of
``S`` on the wire, and counts ``S / 2``. A ZeRO-3 step (gather for the forward, again for the
backward, reduce-scatter) counts ``1.5 S``, ZeRO-2 ``S`` (the root, gathered once, aside).
Evaluation's gathers are not counted (nor are ``allreduce``'s evaluation-time collectives).
``time_comm`` stays 0: FSDP2's collectives run inside forward and backward and count as
compute. Metrics: this worker's persistent bytes, ``param_bytes``, ``grad_bytes`` (what its
gradient shards take during a step), ``optimizer_bytes`` and their sum ``rank_bytes``
(`shard_bytes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer

from .. import comm
from .._compat import dtensor_class, fsdp2
from .._process import tune_allocator
from ..env import DEFAULT_TIMEOUT, DistEnv
from ..errors import UsageError
from ..memory import local_tensor, state_bytes
from ..nn.checkpointing import repeated_blocks
from ..nn.freeze import freeze, frozen_mask, keep_frozen
from ..nn.partial import build_shards, chunk_rows
from ._wrapped_optim import WrappedOptimizer
from .base import Strategy, register

#: the dtype names ``param_dtype`` and ``reduce_dtype`` take, and their canonical name
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32",
          "float64": "float64", "fp64": "float64", "double": "float64"}
_ONE_WORKER_PRECISION = ("Expected 2 or more workers for fsdp's param_dtype / reduce_dtype (one worker shards "
                         "nothing; fit's precision='bf16' runs one process in bfloat16). Received: 1 worker")


#: glibc's mmap threshold in a sharded worker: blocks from 8 MiB up are mapped, as in a pipeline
#: stage (`partrain.strategies.pipeline.STAGE_MMAP_THRESHOLD`). Each step allocates and frees a
#: unit's gathered parameters, its unsharded gradients and the reduce-scatter's buffers; kept in
#: the heap (partrain's 32 MiB threshold elsewhere) they fragment it: a GPT of width 1024 and 8
#: blocks with Adam peaked 1351 MiB above its start per worker, against 1062 with them mapped
#: (allreduce: 1766 and 1702; bench sharded's memory job).
SHARD_MMAP_THRESHOLD = 8 * 1024 * 1024


@register
class FullyShard(Strategy):
    name = "fsdp"
    #: every worker takes the same step: a checkpoint within an epoch resumes exactly
    checkpoints_within_epoch = True
    #: the reduce-scatter averages the workers' gradients every step, as DDP does
    averages_gradients = True
    #: each worker writes its own shards (`partrain.sharded_checkpoint`)
    sharded_checkpoints = True
    holds_part_of_model = True

    def __init__(self, wrap: str = "auto", reshard_after_forward: bool = True, param_dtype: str | None = None,
                 reduce_dtype: str | None = None, offload: bool = False) -> None:
        super().__init__()
        if not isinstance(wrap, str) or not wrap.strip(" ,"):
            raise UsageError(f"Expected wrap to be 'auto', 'root' or module class names ('Block,MLP'). "
                             f"Received: wrap={wrap!r}")
        for key, value in (("reshard_after_forward", reshard_after_forward), ("offload", offload)):
            if not isinstance(value, bool):
                raise UsageError(f"Expected {key} to be true or false. Received: {key}={value!r}")
        self.wrap = wrap.strip()
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = _dtype_name(param_dtype, "param_dtype")
        self.reduce_dtype = _dtype_name(reduce_dtype, "reduce_dtype")
        self.offload = offload
        #: the workers' 1-D DeviceMesh (None: one worker, nothing is sharded)
        self.mesh: Any = None
        self.model: nn.Module | None = None
        self.optimizer: Optimizer | None = None
        self._syncing = True  # False inside `no_sync`: the backward reduces no gradients
        self._bytes_per_forward = 0  # a training forward's all-gathers (and the backward's again)
        self._bytes_per_sync = 0  # a backward's reduce-scatters
        #: this worker's rows of each parameter, where `build_model` built only them
        self._shards: dict[str, torch.Tensor] | None = None

    # ----- topology -------------------------------------------------------------------
    def check_model(self, model: nn.Module, workers: int) -> None:
        """One line in the caller, before any worker starts: a ``wrap`` class the model lacks, or
        mixed precision on one worker (which shards nothing)."""
        if workers > 1:
            sharding_units(model, self.wrap)
        elif self.param_dtype or self.reduce_dtype:
            raise UsageError(_ONE_WORKER_PRECISION)

    def setup(self, env: DistEnv, *, store: Any = None, timeout: float = DEFAULT_TIMEOUT, mesh: Any = None) -> None:
        """``mesh``: a DeviceMesh to shard over (a composed run's ``("dp", "fsdp")`` sub-mesh: 2-D is
        FSDP2's HSDP, replicated along the first dimension, sharded along the second); None: a 1-D
        mesh of every worker."""
        super().setup(env, store=store, timeout=timeout)
        if env.world_size > 1:  # where the launcher tuned the allocator (`tune_allocator`)
            tune_allocator(SHARD_MMAP_THRESHOLD)
        if mesh is not None:
            self.mesh = mesh
        elif self.num_workers > 1 and comm.is_distributed():
            self.mesh = worker_mesh(self.device, self.group, self.num_workers)
        elif self.param_dtype or self.reduce_dtype:
            raise UsageError(_ONE_WORKER_PRECISION)

    # ----- the training loop's side -------------------------------------------------
    def build_model(self, model_fn: Callable[[], nn.Module],
                    weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """The model with each parameter on the meta device and only this worker's shard of it
        built (`partrain.nn.partial.build_shards`: the rows the whole build from the same seed
        gives them, or ``weights``' rows): no worker ever holds the whole model. `prepare` puts the
        shards into the sharded parameters. A model the chunked build cannot follow, one worker,
        CPU offload on an accelerator, or a composed mesh: the whole model, as every strategy
        builds it."""
        self._shards = None
        # offload on an accelerator keeps the shards in host memory, where FSDP2 puts them itself
        if self.mesh is None or self.mesh.ndim != 1 or self.offload and self.device.type != "cpu":
            return super().build_model(model_fn, weights)
        rank, world = self.mesh.get_local_rank(), self.mesh.size()
        built = build_shards(model_fn, rank, world)
        if built is None:
            return super().build_model(model_fn, weights)
        model, self._shards = built
        if weights is not None:
            with torch.no_grad():
                for name, shard in self._shards.items():
                    start, stop = chunk_rows(weights[name].shape[0], rank, world)
                    shard.copy_(weights[name][start:stop])
            model.load_state_dict({k: v for k, v in weights.items() if k not in self._shards}, strict=False)
        return model

    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        """Shard ``model`` (in place: its class becomes FSDP2's, its names stay) and point
        ``optimizer`` at the shards; returns the model and a `ShardedOptimizer` over it."""
        if self.mesh is None:  # one worker: nothing to shard
            model, optimizer = super().prepare(model, optimizer)
            self.model, self.optimizer = model, optimizer
            return model, optimizer
        if optimizer.state:
            raise UsageError("Expected an optimizer that has not stepped yet for strategy 'fsdp' (its state is "
                             f"rebuilt on the shards). Received: state for {len(optimizer.state)} parameters")
        api = fsdp2()
        model, optimizer = super().prepare(model, optimizer)  # on the device
        # start from one model: worker 0's (each worker keeps its piece of its own copy); parameters
        # already split (tensor parallel, composed by `partrain.strategies.mesh`) came from one source
        whole = [t for t in [*model.parameters(), *model.buffers()]
                 if not isinstance(t, dtensor_class()) and not t.is_meta]  # meta: built by shards
        comm.broadcast_tensors([t.data for t in whole], src=self.worker_ranks[0], group=self.group)
        names = {id(p): name for name, p in model.named_parameters()}
        masks = {name: mask for name, p in model.named_parameters() if (mask := frozen_mask(p)) is not None}
        keep_frozen(optimizer).remove()  # whole-tensor guard: the ShardedOptimizer holds the shards instead
        units = sharding_units(model, self.wrap)
        self._plan_bytes(model, units)
        options = self._fsdp_options(api)
        for _, unit in units:
            api.fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **options)
        # the root's parameters are gathered first in the backward too: torch keeps them (None)
        api.fully_shard(model, reshard_after_forward=None if units else self.reshard_after_forward, **options)
        if self._shards is not None:
            self._fill_shards(model)
        sharded = dict(model.named_parameters())
        for name, mask in masks.items():  # the record of what is frozen moves to the sharded parameter
            freeze(sharded[name], mask)
        for group in optimizer.param_groups:
            try:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]
            except KeyError:
                raise UsageError("Expected an optimizer over the model's parameters for strategy 'fsdp'. Received: "
                                 "one holding a tensor that is not a parameter of the model") from None
        model.register_forward_pre_hook(self._count_forward)
        model.register_forward_hook(self._after_forward)
        self.model, self.optimizer = model, ShardedOptimizer(optimizer, model)
        return model, self.optimizer

    def _fill_shards(self, model: nn.Module) -> None:
        """The sharded parameters of a model `build_model` built by shards: storage on the device
        (``to_empty``, which empties everything: the tensors built for real are put back), then
        this worker's rows, as built."""
        def tensors() -> dict[str, torch.Tensor]:
            return {name: local_tensor(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}

        built = {name: t.clone() for name, t in tensors().items() if not t.is_meta}
        model.to_empty(device=self.device)
        shards, self._shards = cast(dict[str, torch.Tensor], self._shards), None
        with torch.no_grad():
            for name, t in tensors().items():
                t.copy_(built[name] if name in built else shards[name])

    def _fsdp_options(self, api: Any) -> dict[str, Any]:
        options: dict[str, Any] = {"mesh": self.mesh}
        if self.param_dtype or self.reduce_dtype:
            options["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=_dtype(self.param_dtype),
                                                            reduce_dtype=_dtype(self.reduce_dtype))
        if self.offload and self.device.type != "cpu":  # on CPU the shards already live in host memory
            options["offload_policy"] = api.CPUOffloadPolicy()
        return options

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Inner micro-batches: the backward keeps its gradients unsharded, nothing is reduced."""
        if self.mesh is None or not isinstance(model, fsdp2().FSDPModule):
            yield
            return
        model.set_requires_gradient_sync(False)
        self._syncing = False
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            self._syncing = True

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard wraps in place: the user's module, whatever its attributes

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full parameters and buffers on worker 0, plain CPU tensors (an empty dict on the
        others). Collective."""
        if self.mesh is None:
            return super().model_state_dict(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def metrics(self) -> dict[str, float]:
        if self.model is None:
            return {}
        return {k: float(v) for k, v in shard_bytes(self.model, self.optimizer).items()}

    # ----- gradients between the exchange and the step -----------------------------------
    def grad_norm(self, params: Any) -> torch.Tensor:
        """The whole model's gradient norm from the shards (one all-reduce), frozen elements zeroed first."""
        params = list(params)
        if self.mesh is None:
            return super().grad_norm(params)
        with torch.no_grad():
            for p, mask in frozen_shards(params):
                if p.grad is not None:
                    local_tensor(p.grad).masked_fill_(mask, 0)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros(())
        norm = torch.nn.utils.get_total_norm(grads)
        return cast(Any, norm).full_tensor() if isinstance(norm, dtensor_class()) else norm

    def clip_grad_norm_(self, params: Any, max_norm: float) -> torch.Tensor:
        params = list(params)
        if self.mesh is None:
            return super().clip_grad_norm_(params, max_norm)
        norm = self.grad_norm(params)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # ----- what moves ---------------------------------------------------------------------
    def _plan_bytes(self, model: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
        """The all-reduce-equivalent bytes of one training forward (with its backward's
        gathers) and of one backward's reduce-scatters, from the unsharded sizes (a tensor-parallel
        slice's: what this worker's group gathers). On a 2-D mesh (HSDP) the gathers and
        reduce-scatters run along the second dimension (none when it has one process) and each
        gradient shard, 1/shards of the whole, is all-reduced along the first."""
        prefixes = [name for name, _ in units]
        gathered: dict[str, int] = {name: 0 for name in [*prefixes, ""]}
        reduced = 0
        for name, p in model.named_parameters():
            owner = max((u for u in prefixes if name.startswith(f"{u}.")), key=len, default="")
            compute = _dtype(self.param_dtype) or p.dtype
            gathered[owner] += local_tensor(p).numel() * compute.itemsize
            if p.requires_grad:
                reduced += local_tensor(p).numel() * (_dtype(self.reduce_dtype) or compute).itemsize
        root_again = not prefixes and self.reshard_after_forward
        again = sum(n for u, n in gathered.items() if u) * self.reshard_after_forward + gathered[""] * root_again
        replicas, shards = (self.mesh.size(0), self.mesh.size(1)) if self.mesh.ndim == 2 else (1, self.mesh.size())
        self._bytes_per_forward = (sum(gathered.values()) + again) // 2 if shards > 1 else 0
        self._bytes_per_sync = (reduced // 2 if shards > 1 else 0) + (reduced // shards if replicas > 1 else 0)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """A forward without gradients (evaluation): no backward will reshard what it gathered
        (the root, every unit under ZeRO-2), so it is resharded now. The model's parameters are
        then its shards between steps, whatever ran last: what the loop's clipping, metrics and
        checkpoints read."""
        if not torch.is_grad_enabled():
            for unit in module.modules():
                if isinstance(unit, fsdp2().FSDPModule):
                    unit.reshard()

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():  # training, not evaluation
            self.comm_bytes += self._bytes_per_forward + (self._bytes_per_sync if self._syncing else 0)


class ShardedOptimizer(WrappedOptimizer):
    """The user's optimizer over the sharded parameters, with the whole model's state dict.

    Its ``param_groups`` and ``state`` are the user's optimizer's (shared: a scheduler
    changing a rate changes it there). ``step()`` steps the shards, holding frozen elements.
    ``state_dict()`` is collective: worker 0 gets the whole model's state, numbered as one
    process's optimizer numbers it; the others get an empty dict. ``load_state_dict`` takes
    such a whole-model state (from any strategy's checkpoint) in every worker and keeps
    each worker's shards (no communication).
    """

    strategy_name = "fsdp"

    def __init__(self, inner: Optimizer, model: nn.Module) -> None:
        super().__init__(inner)
        self.model = model

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        with hold_frozen_shards(self.inner):
            return super().step(closure)

    def _names(self) -> list[list[str]]:
        """Each group's parameters by their names in the model."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        return [[names[id(p)] for p in group["params"]] for group in self.inner.param_groups]

    def state_dict(self) -> dict[str, Any]:
        names = self._names()
        if not self.inner.state:  # nothing stepped yet (torch's call would take a step of lr 0 to make some)
            return self._hooked(_numbered({"state": {}, "param_groups": [{**_settings(g), "params": n}
                                                                         for g, n in zip(self.inner.param_groups, names)]}))
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        named = get_optimizer_state_dict(self.model, self.inner,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self._hooked(_numbered(named)) if named else {}

    def _hooked(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The whole-model state through the state-dict post hooks (``register_state_dict_post_hook``),
        as torch's optimizers run them."""
        for hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        for hook in self._optimizer_load_state_dict_pre_hooks.values():  # as torch's optimizers run them
            state_dict = hook(self, state_dict) or state_dict
        names = self._names()
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(n) for n in names]:
            raise UsageError(f"Expected an optimizer state with {len(names)} groups of {[len(n) for n in names]} "
                             f"parameters (the whole model's). Received: groups of "
                             f"{[len(g['params']) for g in groups]}")
        state, named_groups, missing = {}, [], []
        for group, group_names in zip(groups, names):
            for index, name in zip(group["params"], group_names):
                if index in state_dict["state"]:
                    state[name] = state_dict["state"][index]
                else:
                    missing.append(name)
            named_groups.append({**group, "params": group_names})
        set_optimizer_state_dict(self.model, self.inner, {"state": state, "param_groups": named_groups},
                                 options=StateDictOptions(full_state_dict=True))
        # torch makes every parameter's state (a step of lr 0) before loading: a parameter the
        # checkpoint held none for has none, as in one process
        params = dict(self.model.named_parameters())
        for name in missing:
            self.inner.state.pop(params[name], None)


# ----- pieces ---------------------------------------------------------------------------------

def worker_mesh(device: torch.device, group: Any, workers: int) -> Any:
    """The workers' 1-D DeviceMesh on ``device``'s type: over ``group`` (None: the default group)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if group is None:
        return init_device_mesh(device.type, (workers,))
    return DeviceMesh.from_group(group, device.type)


def sharding_units(model: nn.Module, wrap: str = "auto") -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules `FullyShard` shards before the root, innermost first
    (FSDP2 shards inside out). ``wrap``: ``auto``, ``root`` or class names (see the module)."""
    if wrap == "root":
        return []
    if wrap == "auto":
        found = repeated_blocks(model) or [(n, m) for n, m in model.named_children() if _holds_parameters(m)]
    else:
        wanted = {name.strip() for name in wrap.split(",") if name.strip()}
        found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in wanted]
        missing = wanted - {type(m).__name__ for _, m in found}
        if missing:
            present = sorted({type(m).__name__ for _, m in model.named_modules()})
            raise UsageError(f"Expected modules of class {', '.join(sorted(missing))} in {type(model).__name__} "
                             f"to shard (wrap={wrap!r}). Received: none; its classes are {', '.join(present)}")
        found = [(n, m) for n, m in found if _holds_parameters(m)]
    return sorted(found, key=lambda item: -item[0].count("."))


def shard_bytes(model: nn.Module, optimizer: Optimizer | None = None) -> dict[str, int]:
    """This process's persistent bytes (`partrain.memory.state_bytes`: its shards of the
    parameters, of their gradients and of the optimizer's state) under this strategy's metric
    names, with their sum."""
    held = state_bytes(model, optimizer)
    return {"param_bytes": held["params"], "grad_bytes": held["grads"], "optimizer_bytes": held["optimizer"],
            "rank_bytes": held["params"] + held["grads"] + held["optimizer"]}


def frozen_shards(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, mask of this worker's shard)`` of every frozen parameter among ``params``."""
    out = []
    for p in params:
        mask = frozen_mask(p)
        if mask is not None:
            out.append((p, local_part(mask, p)))
    return out


@contextlib.contextmanager
def hold_frozen_shards(optimizer: Optimizer) -> Iterator[None]:
    """An optimizer step inside leaves the frozen elements of this worker's shards exact, and their
    per-element optimizer state (momentum, Adam's moments): `keep_frozen` for sharded parameters.
    Their gradients are zeroed first, so they feed no momentum."""
    held = []
    with torch.no_grad():
        for p, mask in frozen_shards(q for group in optimizer.param_groups for q in group["params"]):
            if p.grad is not None:
                local_tensor(p.grad).masked_fill_(mask, 0)
            state = {k: local_tensor(v).masked_select(mask) for k, v in optimizer.state.get(p, {}).items()
                     if isinstance(v, torch.Tensor) and k != "step" and v.shape == p.shape}
            held.append((p, mask, local_tensor(p).masked_select(mask), state))
    yield
    with torch.no_grad():
        for p, mask, values, state in held:
            local_tensor(p).masked_scatter_(mask, values)
            now = optimizer.state.get(p, {})
            for k, kept in state.items():
                if isinstance(now.get(k), torch.Tensor):
                    local_tensor(now[k]).masked_scatter_(mask, kept)


def local_part(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` (``p``'s global shape) that this worker's shard of ``p`` holds: FSDP2
    cuts a dimension as ``torch.chunk`` does, one piece per worker (trailing ones may be empty)."""
    if not isinstance(p, dtensor_class()):
        return full.to(p.device)
    sharded: Any = p
    local = sharded.to_local()
    part = full
    for axis, placement in enumerate(sharded.placements):
        if placement.is_shard():
            mesh = sharded.device_mesh
            dim, pieces, rank = placement.dim, mesh.size(axis), mesh.get_local_rank(axis)
            chunks = torch.chunk(part, pieces, dim)
            part = chunks[rank] if rank < len(chunks) else part.narrow(dim, 0, 0)
    if part.shape != local.shape:
        raise RuntimeError(f"fsdp: a shard of shape {tuple(local.shape)} where the frozen mask's piece has "
                           f"{tuple(part.shape)} (placements {sharded.placements})")
    return part.to(local.device)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _dtype_name(value: Any, key: str) -> str | None:
    if value is None or (isinstance(value, str) and value.lower() in ("none", "")):
        return None
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if isinstance(value, str) and value.lower() in DTYPES:
        return DTYPES[value.lower()]
    raise UsageError(f"Expected {key} among {sorted(set(DTYPES.values()))}. Received: {key}={value!r}")


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _numbered(named: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter names (torch.distributed.checkpoint's) numbered as
    one process's ``optimizer.state_dict()`` numbers it: across the groups, in their order."""
    state, groups, index = {}, [], 0
    for group in named["param_groups"]:
        ids = []
        for name in group["params"]:
            if name in named["state"]:
                state[index] = named["state"][name]
            ids.append(index)
            index += 1
        groups.append({**group, "params": ids})
    return {"state": state, "param_groups": groups}
