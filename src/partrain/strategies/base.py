"""The `Strategy` interface and the registry of strategies by name.

A strategy decides how gradients and parameters move between processes; it
never launches processes (that is `partrain.launch`) and never owns the
training loop (that is the user's, or `partrain.fit`). Its life in each
process of a job:

1. ``roles(world_size)`` - the role of every global rank. Most strategies run
   only ``"worker"`` ranks; a parameter server asks for ``"server"`` ranks too
   (``extra_processes(workers)`` tells the launcher how many to add).
2. ``setup(env, store=..., timeout=...)`` - after the process group is up; builds the
   workers' group. The launcher passes the job's key-value store (shared counters,
   e.g. claimed batches) and its timeout (the bound of every wait a strategy makes).
3. On worker ranks the user's function runs: ``model, optimizer =
   strategy.prepare(model, optimizer)``, ``strategy.shard(...)`` for the data,
   then forward / backward / ``optimizer.step()`` as usual. On other ranks the
   launcher calls ``run_role(role)`` instead.
4. ``close()``.

Vocabulary: *rank* is a process's global rank in the job; *worker rank* is its
index among the workers (``strategy.rank``), what data sharding and logging use.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from abc import ABC
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.optim import Optimizer

from .. import comm
from .._compat import backward_with
from .._tree import map_tensors
from ..data.sharding import ClaimingBatchSampler, ShardedBatchSampler
from ..env import DEFAULT_TIMEOUT, DistEnv
from ..errors import UsageError
from ..memory import local_tensor
from ..nn.freeze import keep_frozen
from ..nn.partial import move_model

WORKER = "worker"

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class StepPlan:
    """What the training loop asks of one micro-batch, as one object (`Strategy.train_step`).

    ``loss_fn(output, y)`` returns per-sample losses; the backward pass runs on
    ``loss.sum() * loss_scale`` (the loop's normalisation by the global batch). ``update``:
    the last micro-batch of an accumulation window, so gradients are exchanged and the
    optimizer steps. ``forward_fn(model, x)`` calls the model (default ``model(x)``).
    ``before_update()`` runs between the exchange and the step (clipping, the NaN policy);
    when it returns False the step's gradient is dropped.
    """

    loss_fn: LossFn
    loss_scale: float = 1.0
    update: bool = True
    forward_fn: Callable[[nn.Module, Any], Any] | None = None
    before_update: Callable[[], bool] | None = None

    def backward(self, per_sample: torch.Tensor) -> None:
        """The backward pass of ``per_sample.sum() * loss_scale``, run as ``per_sample``'s with a
        gradient of ``loss_scale`` everywhere: the same gradients (the sum's backward spreads the
        scaled one), without the sum, the product and their backward nodes in every step (4 of a
        small model's ~45 operator calls per step). The gradient tensor is kept for the next step of
        the same shape."""
        grad = self.__dict__.get("_grad")
        if (grad is None or grad.shape != per_sample.shape or grad.dtype != per_sample.dtype
                or grad.device != per_sample.device):
            grad = torch.full_like(per_sample, self.loss_scale, requires_grad=False)
            object.__setattr__(self, "_grad", grad)  # a cache on a frozen plan: not one of its fields
        backward_with(per_sample, grad)

    @classmethod
    def of(cls, plan: StepPlan | LossFn, **options: Any) -> StepPlan:
        """``plan`` itself, or a plan for a bare loss function and keyword options
        (``train_step(model, opt, x, y, loss_fn, loss_scale=...)``, as scripts call it)."""
        if isinstance(plan, StepPlan):
            if options:
                raise UsageError(f"Expected a StepPlan or a loss function with options. Received: a StepPlan "
                                 f"and {sorted(options)}")
            return plan
        return cls(plan, **options)


class Strategy(ABC):
    """How one training loop runs on many processes. Subclasses set ``name``."""

    name: ClassVar[str] = ""
    #: the launcher keeps the job running when a worker process dies
    survives_worker_loss: ClassVar[bool] = False
    #: workers claim batches from a shared counter instead of fixed shares (asynchronous
    #: strategies: a fast worker is not held back by a slow one at the epoch's end)
    dynamic_sharding: ClassVar[bool] = False
    #: the most worker processes the strategy can run (None: any number)
    max_workers: ClassVar[int | None] = None
    #: every worker holds the same parameters after every step, so a checkpoint within an
    #: epoch resumes exactly (`fit`'s checkpoint_every); not so for asynchronous or local steps
    checkpoints_within_epoch: ClassVar[bool] = False
    #: one worker's whole step (forward, backward, update) may run as one compiled function:
    #: nothing moves between processes outside ``optimizer.step()`` (`partrain.train.compiling`)
    fuses_steps: ClassVar[bool] = False
    #: the workers' gradients are averaged every optimizer step (all-reduce): a step's loss is
    #: divided by what the whole global batch holds (`step_units`), not by this worker's share
    averages_gradients: ClassVar[bool] = False
    #: each process holds part of the model: `fit`'s checkpoints are torch.distributed.checkpoint
    #: shards that every process writes and reads its own part of (`partrain.sharded_checkpoint`),
    #: not one file gathered on worker 0
    sharded_checkpoints: ClassVar[bool] = False
    #: with more than one worker, no process holds the whole model (shards, stages, split
    #: matrices): the caller checks the model against the data on the meta device, never built whole
    holds_part_of_model: ClassVar[bool] = False

    def __init__(self) -> None:
        self.env = DistEnv()
        #: the job's c10d store (None in a one-process run) and the bound of every wait, from setup
        self.store: Any = None
        self.timeout = DEFAULT_TIMEOUT
        self.group: Any = None  # the workers' process group; None = the default group
        self.worker_ranks: list[int] = [0]
        #: exposed communication time (seconds the loop waited on the network)
        self.comm_seconds = 0.0
        #: bytes this worker put into collectives / messages
        self.comm_bytes = 0
        self._samplers = 0  # samplers made so far: names each one's shared counter

    # ----- topology -------------------------------------------------------------------
    def extra_processes(self, workers: int) -> int:
        """Processes the launcher starts besides ``workers`` (e.g. parameter servers)."""
        return 0

    def data_parallel_workers(self, workers: int) -> int:
        """`num_workers` of a job of ``workers`` worker processes, known before any starts."""
        return workers

    def check_model(self, model: nn.Module, workers: int) -> None:
        """The caller's look at one model built there, before any worker starts (``workers``: the
        job's worker processes): one line for what `prepare` would refuse there (a tensor-parallel
        plan that names no module, heads that do not divide). Here: nothing."""

    def roles(self, world_size: int) -> list[str]:
        """The role of each global rank."""
        return [WORKER] * world_size

    def describe_rank(self, rank: int, world_size: int) -> str | None:
        """How errors name global rank ``rank`` when its role and number say too little
        (a pipeline's ``stage 1 (rank 1)``); None: ``<role> rank <rank>``."""
        return None

    def run_role(self, role: str) -> Any:
        """Body of a non-worker rank (e.g. a parameter server's serving loop)."""
        raise NotImplementedError(f"strategy {self.name!r} has no role {role!r}")

    def setup(self, env: DistEnv, *, store: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Called in every process once the process group is initialized (if any).

        ``store`` is the job's c10d store (the launcher's, under torchrun one joined at
        ``MASTER_ADDR:MASTER_PORT``); ``timeout`` bounds every wait the strategy makes.
        """
        self.env = env
        self.store = store
        self.timeout = timeout
        roles = self.roles(env.world_size)
        self.worker_ranks = [r for r, role in enumerate(roles) if role == WORKER]
        if not self.worker_ranks:
            raise UsageError(f"Expected at least one worker. Received roles {roles}")
        if comm.is_distributed() and len(self.worker_ranks) < env.world_size:
            # every rank must take part in creating a group, workers or not
            self.group = comm.new_group(self.worker_ranks, timeout=timeout)

    @property
    def role(self) -> str:
        return self.roles(self.env.world_size)[self.env.rank]

    @property
    def rank(self) -> int:
        """This process's index among the workers."""
        return self.worker_ranks.index(self.env.rank) if self.env.rank in self.worker_ranks else -1

    @property
    def num_workers(self) -> int:
        return len(self.worker_ranks)

    @property
    def is_main(self) -> bool:
        """True on worker 0: the process that logs, shows progress and writes files."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return self.env.device

    # ----- the training loop's side -------------------------------------------------
    def build_model(self, model_fn: Callable[[], nn.Module],
                    weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """This process's model, from ``model_fn()`` with the random state the caller seeded (and
        ``weights``, a whole model's state dict, loaded): the whole model. A strategy whose
        processes each hold a part of it builds that part alone, the rest on the meta device, with
        the values the whole build gives it: ``pipeline`` its stages, ``fsdp`` its shards."""
        model = model_fn()
        if weights is not None:
            model.load_state_dict(weights)
        return model

    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        """Wrap ``model`` and ``optimizer`` for this strategy (they keep their interfaces).

        Every strategy attaches `keep_frozen` to the optimizer that steps: frozen slices
        (`partrain.nn.freeze`) stay exact under it.
        """
        keep_frozen(optimizer)
        return move_model(model, self.device), optimizer

    def shard(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
              drop_last: bool = False, dataset_size: int | None = None) -> ShardedBatchSampler:
        """This worker's batches of an epoch of ``num_samples``: every sample once per epoch across
        workers (an epoch shorter than ``dataset_size`` walks on through the dataset's passes).

        Fixed, equal shares; with ``dynamic_sharding``, batches claimed from a counter the
        job shares (`ClaimingBatchSampler`). Every worker must call ``shard`` equally often.
        """
        self._samplers += 1
        if self.dynamic_sharding and self.num_workers > 1:
            if self.store is None:
                raise UsageError(f"Expected a store for strategy {self.name!r} to share batches across "
                                 f"{self.num_workers} workers. Received: setup() without one")
            return ClaimingBatchSampler(num_samples, batch_size, max(self.rank, 0), self.num_workers,
                                        store=self.store, key=f"partrain/claims/{self._samplers}",
                                        shuffle=shuffle, seed=seed, drop_last=drop_last,
                                        dataset_size=dataset_size)
        return ShardedBatchSampler(num_samples, batch_size, max(self.rank, 0), self.num_workers,
                                   shuffle=shuffle, seed=seed, drop_last=drop_last, dataset_size=dataset_size)

    def train_step(self, model: nn.Module, optimizer: Optimizer, x: Any, y: Any,
                   plan: StepPlan | LossFn, **options: Any) -> tuple[Any, torch.Tensor]:
        """One micro-batch: forward, per-sample loss, backward of ``loss.sum() * plan.loss_scale``.

        ``plan`` is a `StepPlan` (or a bare loss function, with the plan's fields as keyword
        options). ``x`` is whatever the model takes. With ``plan.update`` (the last micro-batch
        of an accumulation window) the gradients are exchanged and the optimizer steps;
        without, the micro-batch runs under `no_sync` - the forward pass too, since DDP decides
        there whether the backward communicates. When ``plan.before_update()`` returns False the
        step's gradient is dropped (the optimizer still steps, with no gradient, so every
        worker's step count stays the same). Returns the output and the per-sample losses,
        detached. A strategy that schedules forward and backward itself (a pipeline's
        micro-batches across stages) overrides this; the others differ in what
        ``optimizer.step()`` does.
        """
        plan = StepPlan.of(plan, **options)
        with contextlib.nullcontext() if plan.update else self.no_sync(model):
            out = plan.forward_fn(model, x) if plan.forward_fn is not None else model(x)
            per_sample = plan.loss_fn(out, y)
            plan.backward(per_sample)
        if plan.update:
            if plan.before_update is not None and not plan.before_update():
                optimizer.zero_grad(set_to_none=True)
            self.optimizer_step(optimizer)
        return detach(out), per_sample.detach()

    def optimizer_step(self, optimizer: Optimizer) -> None:
        """Apply the accumulated gradients and clear them."""
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Inner steps of gradient accumulation: skip communication when the strategy can."""
        yield

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``prepare`` added."""
        return getattr(model, "module", model)

    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The full, current parameters for a checkpoint (strategies holding them elsewhere override)."""
        return self.unwrap(model).state_dict()

    def metrics(self) -> dict[str, float]:
        """Strategy-specific figures for logs (staleness, dropped gradients, ...)."""
        return {}

    def step_units(self, local: float) -> float:
        """What one optimizer step's summed loss is divided by (times ``num_workers``, which the
        gradient average divides again), from this worker's ``local`` count of loss units
        (samples, valid tokens): the global batch's when the workers' gradients are averaged
        every step (one small all-reduce), else ``num_workers`` times this worker's own (each
        worker's step is the mean over its own batch)."""
        if not self.averages_gradients or self.num_workers == 1:
            return float(local) * self.num_workers
        return float(self.all_reduce_sum(torch.tensor([float(local)], dtype=torch.float64)).item())

    # ----- collectives over the workers ---------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce_sum(tensor, self.group)

    def barrier(self) -> None:
        comm.barrier(self.group)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src`` is a worker rank."""
        return comm.broadcast_object(obj, self.worker_ranks[src], self.group)

    # ----- gradients between the exchange and the step -----------------------------------
    def grad_norm(self, params: Any) -> torch.Tensor:
        """The 2-norm of the model's gradient, for `fit`'s ``on_nan="skip"``. Here: of the
        gradients this process holds, the whole model's once exchanged. A strategy whose
        processes each hold a part (pipeline stages) combines the parts (a collective)."""
        grads = [p.grad for p in params if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def clip_grad_norm_(self, params: Any, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` by the whole model's norm (see `grad_norm`)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    # ----- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This strategy's own state, from a checkpoint the same strategy wrote."""

    def unused_state(self, state: dict[str, Any]) -> str | None:
        """What of a checkpoint's state (this strategy's own kind) the options of this instance
        leave unused, for the line a resume prints; None when every part is used."""
        return None

    @classmethod
    def optimizer_state_in(cls, state: Any, numels: list[int]) -> dict[int, dict[str, Any]] | None:
        """The optimizer's per-parameter state that this strategy's checkpoint entry ``state``
        holds in place of the checkpoint's ``optimizer`` entry (a parameter server keeps it on
        its servers), as in ``optimizer.state_dict()["state"]``, for another strategy to resume
        with. None: the checkpoint's ``optimizer`` entry has it. ``numels``: the sizes of the
        resuming optimizer's parameters."""
        return None

    def checkpoint_layout(self, param: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                                               Callable[[torch.Tensor], torch.Tensor]] | None:
        """For a sharded checkpoint: ``(to_saved, from_saved)`` when ``param`` (and its optimizer
        state) is held in another layout than training keeps it (rows reordered for the split),
        None when it is saved as it is (a DTensor as its shards). Here: None."""
        return None

    def adopt_optimizer_state(self, state: dict[str, Any] | None) -> None:
        """A checkpoint another strategy wrote: the optimizer has just loaded ``state`` (its
        ``state_dict()``, the whole model's). A strategy that keeps the optimizer state
        elsewhere (ps: on its servers) takes it from there. Collective. Here: nothing to do."""

    def close(self) -> None:
        pass

    def options(self) -> dict[str, Any]:
        """The constructor options this instance was built with (for logs and checkpoints)."""
        sig = inspect.signature(type(self).__init__)
        return {k: getattr(self, k) for k in sig.parameters if k != "self" and hasattr(self, k)}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"



def clip_with_norm_(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """Every gradient of ``params`` scaled by ``min(1, max_norm / (norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` scales them, for a ``norm`` a strategy computed over the
    whole model (each process holding part of it); a sharded gradient (a DTensor) is scaled in
    its local shard. Returns ``norm``."""
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            local_tensor(p.grad).detach().mul_(scale.to(p.grad.dtype))
    return norm


def detach(obj: Any) -> Any:
    """Every tensor of a nested output detached from the graph."""
    return map_tensors(obj, torch.Tensor.detach)


_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a strategy available by its ``name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty name")
    _REGISTRY[cls.name] = cls
    return cls


def strategy_class(name: str) -> type[Strategy] | None:
    """The registered class named ``name`` (None: no such strategy)."""
    _load_builtin()
    return _REGISTRY.get(name)


def available() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def get_strategy(strategy: Strategy | str, **options: Any) -> Strategy:
    """A strategy instance from a name and options (or the instance itself)."""
    if isinstance(strategy, Strategy):
        if options:
            raise UsageError(f"Expected options only with a strategy name. Received an instance and {options}")
        return strategy
    _load_builtin()
    if strategy not in _REGISTRY:
        raise UsageError(f"Expected a strategy among {sorted(_REGISTRY)}. Received: {strategy!r}")
    cls = _REGISTRY[strategy]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise UsageError(
            f"Expected options of strategy {strategy!r} among {accepted or '(none)'}. Received: {', '.join(unknown)}"
        )
    try:
        return cls(**options)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"Bad options for strategy {strategy!r}: {exc}") from None


def parse_options(strategy: str, pairs: list[str]) -> dict[str, Any]:
    """``["staleness=2", "outer=nesterov"]`` -> typed options, using the constructor's defaults."""
    _load_builtin()
    cls = _REGISTRY.get(strategy)
    params = inspect.signature(cls.__init__).parameters if cls else {}
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UsageError(f"Expected a strategy option as KEY=VALUE. Received: {pair!r}")
        default = params[key].default if key in params else None
        out[key] = _coerce(raw.strip(), default, key)
    return out


def _coerce(raw: str, default: Any, key: str) -> Any:
    try:
        if isinstance(default, bool):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if isinstance(default, int) and raw.lower() not in ("inf", "infinity"):
            return int(raw)
        if isinstance(default, (int, float)):
            value = float(raw)
            return math.inf if math.isinf(value) else value
        if default is None:
            for conv in (int, float):
                with contextlib.suppress(ValueError):
                    return conv(raw)
        return raw
    except ValueError:
        raise UsageError(
            f"Expected option {key} to be a {type(default).__name__}. Received: {raw!r}"
        ) from None


def _load_builtin() -> None:
    # importing the modules registers their strategies
    import importlib

    for mod in ("single", "allreduce", "parameter_server", "hogwild", "local_sgd", "pipeline", "fsdp",
                "tensor_parallel", "mesh"):
        try:
            importlib.import_module(f"partrain.strategies.{mod}")
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("partrain.strategies"):
                raise
