"""``pipeline``: model parallel training, the model's layers split over processes.

A model too big for one process is cut into ``stages`` chunks, one per process: an
``nn.Sequential`` between its children, a transformer between the blocks of its block list
(an ``nn.ModuleList`` its forward pass runs in order: the built-in GPT, Hugging Face models),
any other model by torch's tracer (`partrain.strategies._pipeline_module`). A global batch
is cut into ``microbatches`` that flow through the stages so that every stage works on
some micro-batch most of the time. The schedule (the
order of forward and backward passes of the micro-batches on each stage) is
``torch.distributed.pipelining``'s, chosen by name: ``gpipe``, ``1f1b``, ``interleaved1f1b``,
``loopedbfs``, ``interleavedzerobubble``, ``zbvzerobubble``, ``dualpipev`` (the last five
run ``virtual_stages`` chunks per process, 2 by default).

With more processes than stages the job is *hybrid*: ``workers / stages`` pipeline replicas
(the ``dp`` axis) each train on their share of the data, and every stage all-reduces its
gradients with the same stage of the other replicas (the ``pp`` axis runs one pipeline). The
groups are the dimensions of the job's DeviceMesh (`partrain.mesh`, ``("dp", "pp")``):
global rank ``r`` is stage ``r % stages`` of replica ``r // stages``.

What torch's API leaves to the user, this strategy does:

- a batch that does not divide into micro-batches (the last of an epoch) is padded with
  copies of its own samples, whose losses are left out: the gradient is exactly that of
  the real samples;
- the loss is computed on the last stage, per sample, and normalised by the global batch
  as under every other strategy (`partrain.train.task`), so k steps equal one process
  (``single``) on the same global batches;
- the optimizer of each stage steps that stage's parameters and behaves as one optimizer
  (`StageOptimizer`: one state dict in the whole model's numbering, LR schedulers);
- a parameter that stages on several processes use (an embedding tied to the output layer,
  on the first and the last stage) is trained on each with the sum of their gradients, as in
  one process;
- checkpoints gather the whole model to the first stage (an ordinary partrain checkpoint,
  which ``single``, ``allreduce`` and ``partrain serve`` load) and a pipeline resumes from one;
- ``model(x)`` (evaluation, under ``torch.no_grad()``) runs the pipeline forward on every
  stage with the same ``x``, in micro-batches, and returns the output on every stage;
- the step-time breakdown: ``comm`` counts the time stages waited for neighbours (the
  *bubble*, also reported alone as ``pipeline_bubble_seconds``) and the gradient all-reduce.

A training step is one call on every stage with the same batch (the first stage reads
the inputs, the last the targets)::

    out, losses = strategy.train_step(model, optimizer, x, y, loss_fn)  # loss_fn: per sample

Vocabulary: a *stage* is one chunk of the model (``stages * virtual_stages`` of them); a
*pipeline rank* is a process's index within its pipeline (``pp``), a *replica* its
pipeline's index (``dp``), the data-parallel worker rank (``strategy.rank``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from .. import comm
from .._process import tune_allocator
from ..batch import batch_size
from ..env import DEFAULT_TIMEOUT, DistEnv
from ..errors import UsageError
from ..mesh import MeshSpec, build_mesh
from ..nn.partial import build_part
from ..nn.split import (
    SCHEDULES,
    chunk_ranges,
    give_back_freed_memory,
    plan_cuts,
    sequential_children,
    stage_ranks,
)
from ._pipeline_module import PipelineModule, pipeline_module
from ._pipeline_optim import StageOptimizer, recv_object, send_object
from ._pipeline_trace import split_points
from .base import LossFn, StepPlan, Strategy, clip_with_norm_, register

if TYPE_CHECKING:  # the runtime imports torch.distributed.pipelining: seconds, paid by a pipeline only
    from ._pipeline_runtime import Runtime


#: glibc's mmap threshold in a stage process: blocks from 8 MiB (2M float32) up are mapped.
#: A pipeline is for models too large for one process, whose parameter-sized blocks
#: (gradients, optimizer state and its temporaries) are allocated and freed every step. In the
#: heap (partrain's 32 MiB threshold elsewhere) their 64-byte-aligned requests do not fit the
#: holes freed blocks of the same size leave: a stage of 4 x Linear(2048) with Adam peaked 400-445
#: MiB above its start, against 316-320 with those blocks mapped (bench pipeline's memory job).
#: Smaller blocks (a micro-batch's activations, a Linear(1024)'s gradient) stay in the heap,
#: where a step reuses them without page faults.
STAGE_MMAP_THRESHOLD = 8 * 1024 * 1024


@register
class Pipeline(Strategy):
    name = "pipeline"
    checkpoints_within_epoch = True
    averages_gradients = True
    holds_part_of_model = True

    def __init__(self, stages: int = 2, microbatches: int = 4, schedule: str = "1f1b", split: str = "params",
                 virtual_stages: int = 0) -> None:
        super().__init__()
        if not isinstance(stages, int) or stages < 2:
            raise UsageError(f"Expected stages to be an integer of at least 2 (one stage is data parallel: "
                             f"strategy 'allreduce'). Received: stages={stages!r}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise UsageError(f"Expected microbatches to be a positive integer. Received: microbatches={microbatches!r}")
        key = str(schedule).lower().replace("-", "").replace("_", "")
        if key not in SCHEDULES:
            raise UsageError(f"Expected a schedule among {list(SCHEDULES)}. Received: {schedule!r}")
        _, multi, style = SCHEDULES[key]
        if virtual_stages == 0:
            virtual_stages = 2 if multi else 1
        if not multi and virtual_stages != 1:
            raise UsageError(f"Expected virtual_stages=1 for schedule {key!r} (one stage per process). "
                             f"Received: virtual_stages={virtual_stages}")
        if multi and (virtual_stages < 2 or (style == "v" and virtual_stages != 2)):
            want = "2" if style == "v" else "at least 2"
            raise UsageError(f"Expected virtual_stages={want} for schedule {key!r}. "
                             f"Received: virtual_stages={virtual_stages}")
        self.stages = stages
        self.microbatches = microbatches
        self.schedule = key
        self.split = str(split)
        self.virtual_stages = virtual_stages
        # topology, from setup
        self.pp_rank, self.dp_rank, self.replicas = 0, 0, 1
        self.pp_group: Any = None
        self.dp_group: Any = None
        self.pp_ranks: list[int] = [0]  # global ranks of this process's pipeline
        # the split, from prepare (or the first batch, for split="time")
        self.runtime: Runtime | None = None
        self._built_cuts: list[int] | None = None  # where build_model cut, when it built only this part
        #: seconds stages computed, and waited for neighbours, within schedule steps
        self.compute_seconds = 0.0
        self.bubble_seconds = 0.0
        self.step_seconds = 0.0

    # ----- topology -------------------------------------------------------------------
    def extra_processes(self, workers: int) -> int:
        """None; the launcher asks before it starts anything, so a worker count that does not
        fit the stages is refused here, in one line, instead of in every worker."""
        self._check_world(workers)
        return 0

    def data_parallel_workers(self, workers: int) -> int:
        """The replicas: every stage of a replica sees the same batches."""
        return workers // self.stages

    def describe_rank(self, rank: int, world_size: int) -> str | None:
        """``stage 1 (rank 1)``; with replicas ``stage 1 of replica 0 (rank 1)``."""
        stage, replica = rank % self.stages, rank // self.stages
        of_replica = f" of replica {replica}" if world_size > self.stages else ""
        return f"stage {stage}{of_replica} (rank {rank})"

    def _check_world(self, world: int) -> None:
        if world < self.stages or world % self.stages:
            raise UsageError(f"Expected a number of workers divisible by stages={self.stages} (one process per "
                             f"stage, times the data-parallel replicas). Received: {world} worker(s)")

    def setup(self, env: DistEnv, *, store: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().setup(env, store=store, timeout=timeout)
        if env.world_size > 1:  # where the launcher tuned the allocator (`tune_allocator`)
            tune_allocator(STAGE_MMAP_THRESHOLD)
        world = env.world_size
        self._check_world(world)
        p = self.stages
        self.replicas = world // p
        self.pp_rank, self.dp_rank = env.rank % p, env.rank // p
        self.pp_ranks = [self.dp_rank * p + i for i in range(p)]
        if self.replicas > 1:  # the job's mesh: replicas outside (dp), stages inside (pp)
            mesh = build_mesh(MeshSpec(dp=self.replicas, pp=p), env.device.type, timeout=timeout)
            self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        else:
            self.pp_group = None  # the default group: every process is one pipeline

    @property
    def num_workers(self) -> int:
        """Data-parallel workers: the pipeline replicas (every stage of a replica sees the same batches)."""
        return self.replicas

    @property
    def rank(self) -> int:
        """This process's replica: what data sharding and the loop's seeds use."""
        return self.dp_rank

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.runtime is not None and 0 in self.runtime.owned

    @property
    def last_stage(self) -> bool:
        return self.runtime is not None and self.runtime.num_chunks - 1 in self.runtime.owned

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the replicas, as the first stage of each holds it, on every stage.

        The stages of a replica agree on what the loop sums (losses and outputs come from the
        last stage to all) but not on their own clocks and random states: the first stage's
        count (it is the one that writes checkpoints and decides when they are due).
        """
        if self.replicas > 1:
            comm.all_reduce_sum(tensor, self.dp_group)
        if self.stages > 1:
            comm.broadcast_into(tensor, self.pp_ranks[0], self.pp_group)
        return tensor

    def barrier(self) -> None:
        comm.barrier(None)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src`` is a replica: its first stage sends."""
        return comm.broadcast_object(obj, src * self.stages, None)

    # ----- build and prepare: this process's stages of the model -------------------------
    def build_model(self, model_fn: Callable[[], nn.Module],
                    weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """Only this process's stages of an ``nn.Sequential`` cut by parameters or child names,
        the other stages' parameters on the meta device; each stage's initial values are those
        the whole model built from the same seed has (`partrain.nn.partial`). Any other model, or
        a split by time (it needs a batch), is built whole and cut as before."""
        self._built_cuts = None
        if self.split == "time":
            return super().build_model(model_fn, weights)
        found: dict[str, Any] = {}

        def keep(skeleton: nn.Module) -> set[str] | None:
            if not isinstance(skeleton, nn.Sequential):
                return None
            children = sequential_children(skeleton)
            chunks = self.stages * self.virtual_stages
            if chunks > len(children):
                return None  # prepare says why, in one line
            found["cuts"] = cuts = plan_cuts(children, chunks, self.split)
            owner = stage_ranks(chunks, self.stages, SCHEDULES[self.schedule][2])
            mine = [i for s, r in enumerate(chunk_ranges(cuts, len(children))) if owner[s] == self.pp_rank for i in r]
            return {f"{children[i][0]}.{name}" for i in mine
                    for name, _ in children[i][1].named_parameters(remove_duplicate=False)}

        model, partial = build_part(model_fn, keep)
        if partial:
            self._built_cuts = found["cuts"]  # prepare cuts where the build did
        if weights is not None:
            model.load_state_dict(weights)  # the other stages' parameters stay on meta
        return model

    def prepare(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        """This process's stages of ``model`` and an optimizer over their parameters.

        An ``nn.Sequential`` is cut between its children now (``split="time"``: at the first
        batch); any other model at the first batch, between its blocks or by torch's tracer.
        """
        model, optimizer = super().prepare(model, optimizer)
        optim = StageOptimizer(optimizer, [], [], self._gather_states)
        module = PipelineModule(self, model, optim)
        if not isinstance(model, nn.Sequential):
            if self.split == "time":
                split_points(model, (), 0, self.split)  # the one line, now rather than at the first batch
            return module, optim
        children = self._cuttable(model)
        chunks = self.stages * self.virtual_stages
        if self._built_cuts is not None:
            module._cut(self._built_cuts)
        elif self.split != "time":
            module._cut(plan_cuts(children, chunks, self.split))
        return module, optim

    def check_model(self, model: nn.Module, workers: int) -> None:
        """One line in the caller, before any process starts: an ``nn.Sequential`` with fewer
        children than chunks to cut (other models are cut at the first batch)."""
        if isinstance(model, nn.Sequential):
            self._cuttable(model)

    def _cuttable(self, model: nn.Sequential) -> list[tuple[str, nn.Module]]:
        """The children a Sequential is cut between; one line when they are fewer than the chunks."""
        children = sequential_children(model)
        chunks = self.stages * self.virtual_stages
        if chunks > len(children):
            names = ", ".join(n for n, _ in children)
            raise UsageError(f"Expected at least {chunks} top-level children to cut into {chunks} stages. "
                             f"Received: a model with {len(children)} ({names})")
        return children

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    # ----- one training step ------------------------------------------------------------
    def train_step(self, model: nn.Module, optimizer: Optimizer, x: Any, y: Any,
                   plan: StepPlan | LossFn, **options: Any) -> tuple[Any, torch.Tensor]:
        """One global batch through the pipeline on every stage (each stage calls this with the
        same ``x`` and ``y``); see `Strategy.train_step` for the arguments. Returns the output
        and per-sample losses on every stage (sent from the last)."""
        plan = StepPlan.of(plan, **options)
        module = pipeline_module(model)
        runtime = module._ensure_cut(x, plan.forward_fn)
        if not runtime.trimmed:  # by now the caller dropped the whole model it handed to prepare
            gc.collect()
            give_back_freed_memory()
            runtime.trimmed = True
        n = batch_size(y, x)
        if n > 0:
            out, per_sample = runtime.run(x, y, n, plan.loss_fn, plan.loss_scale, plan.forward_fn)
        else:  # a replica's share of the last global batch can be empty: it still all-reduces
            out, per_sample = runtime.empty_output(), torch.zeros(0, dtype=torch.float64, device=self.device)
        if plan.update:
            self._exchange_gradients(runtime)
            if not self._agree(plan.before_update):
                optimizer.zero_grad(set_to_none=True)
            self.optimizer_step(optimizer)
        return out, per_sample

    def _exchange_gradients(self, runtime: Runtime) -> None:
        runtime.sum_shared_grads()
        if self.replicas <= 1:
            return
        params = [p for p in runtime.parameters() if p.requires_grad]
        if not params:
            return
        start = time.perf_counter()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = comm.flatten([p.grad for p in params])
        self.comm_bytes += flat.numel() * flat.element_size()
        comm.all_reduce_mean(flat, self.dp_group)
        comm.unflatten_into(flat, [p.grad for p in params])
        self.comm_seconds += time.perf_counter() - start

    def grad_norm(self, params: Any) -> torch.Tensor:
        """The whole model's gradient norm (2-norm over every stage's gradients; collective over
        the pipeline: every stage calls it). For `fit`'s ``clip_grad`` / ``on_nan="skip"``, which
        today take the norm of the parameters they hold (this stage's): see docs."""
        skip = self.runtime.counted_elsewhere if self.runtime is not None else set()  # tied: counted once
        grads = [p.grad.detach() for p in params if p.grad is not None and id(p) not in skip]
        local = (torch.nn.utils.get_total_norm(grads).to(torch.float64) ** 2 if grads
                 else torch.zeros((), dtype=torch.float64, device=self.device))
        total = local.reshape(1).to(self.device)
        dist.all_reduce(total, group=self.pp_group)
        return total[0].sqrt()

    def clip_grad_norm_(self, params: Any, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` with the whole model's norm (collective, as `grad_norm`)."""
        params = list(params)
        return clip_with_norm_(params, max_norm, self.grad_norm(params))

    def _agree(self, before_update: Callable[[], bool] | None) -> bool:
        """``before_update`` on every stage; the step's gradient is kept only if every stage agrees
        (a stage that raised makes the others raise too, naming it)."""
        if before_update is None:
            return True
        code, error = 1, None
        try:
            code = 1 if before_update() else 0
        except Exception as exc:  # re-raised below, after the others heard of it
            code, error = -1, exc
        if self.stages > 1:
            flag = torch.tensor([code], dtype=torch.int64, device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pp_group)
            if error is None and int(flag) < 0:
                # worded as an echo ("closed"): the launcher reports the stage that raised, not this one
                raise RuntimeError(f"pipeline stage {self.pp_rank}: the step was closed by another stage's error")
            code = min(code, int(flag))
        if error is not None:
            raise error
        return code > 0

    # ----- checkpoints --------------------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The whole model's parameters on the first stage of each replica (gathered from the
        other stages; every stage must call this); the other stages get their own part."""
        module = pipeline_module(model)
        if module.runtime is None:  # not cut yet (split="time" before the first batch)
            return module.full_state_dict()
        return module.runtime.gather_state()

    def _gather_states(self, own: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every stage's optimizer state on the first stage (None elsewhere)."""
        if self.stages == 1:
            return [own]
        if self.pp_rank == 0:
            return [own] + [recv_object(src, self.pp_group) for src in self.pp_ranks[1:]]
        send_object(own, self.pp_ranks[0], self.pp_group)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"stages": self.stages, "schedule": self.schedule}

    def metrics(self) -> dict[str, float]:
        figures = {"bubble_seconds": self.bubble_seconds, "compute_seconds": self.compute_seconds}
        if self.step_seconds > 0:
            figures["utilisation"] = self.compute_seconds / self.step_seconds
        return figures


__all__ = ["SCHEDULES", "Pipeline", "PipelineModule"]
