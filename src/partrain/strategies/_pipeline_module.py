"""The model a pipeline's process holds: its stages of the whole model, cut one of three ways.

- an ``nn.Sequential``: between its children (no tracing);
- a model whose forward pass runs a block list (an ``nn.ModuleList`` of transformer blocks):
  between its blocks, every stage calling the model's own forward pass
  (`partrain.strategies._pipeline_blocks`; no tracing, so the built-in GPT and Hugging Face
  models, which torch.export cannot trace, are cut too);
- any other model: by torch's tracer (`partrain.strategies._pipeline_trace`).

A parameter that stages of more than one process hold (a weight tied across the cut) is
found here and its gradient summed over them at each step (`Runtime.sum_shared_grads`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import comm
from ..batch import describe
from ..errors import UsageError
from ..nn.partial import on_meta
from ..nn.split import SCHEDULES, as_args, chunk_ranges, first_rows, plan_cuts, rows, stage_ranks
from ._pipeline_blocks import BlockStage, ForwardFn, plan_blocks
from ._pipeline_optim import StageOptimizer, keep_stage_params
from ._pipeline_trace import split_points, trace_stages

if TYPE_CHECKING:  # the runtime imports torch.distributed.pipelining: seconds, paid by a pipeline only
    from ._pipeline_blocks import BlockSplit
    from ._pipeline_runtime import Runtime
    from .pipeline import Pipeline

Layout = list[tuple[str, int, tuple[int, ...], torch.dtype]]


class PipelineModule(nn.Module):
    """This process's stages of a model cut into a pipeline.

    Its children are the original model's children that this process runs, under their
    own names (so ``state_dict()`` keys are the whole model's); for a model cut between its
    blocks, the model itself (``model``) with the other processes' blocks taken out; for a
    traced model, the stage modules (``stage0``, ...; their own keys are the whole model's).
    Calling it runs the whole pipeline forward: every stage must call it with the same input
    (evaluation).
    """

    def __init__(self, strategy: Pipeline, model: nn.Module, optimizer: StageOptimizer) -> None:
        super().__init__()
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "runtime", None)
        object.__setattr__(self, "whole", not isinstance(model, nn.Sequential))
        # the model's parameters in its own order, the same on every process (for tied weights)
        object.__setattr__(self, "_named", list(model.named_parameters()))
        # until the cut (split="time" and models that are not a Sequential wait for a batch) the
        # whole model stays here
        if self.whole:
            self.add_module("model", model)
            object.__setattr__(self, "_children_list", None)
        else:
            children = list(model.named_children())
            for name, child in children:
                self.add_module(name, child)
            object.__setattr__(self, "_children_list", children)

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's state before the cut."""
        return self._modules["model"].state_dict() if self.whole else self.state_dict()

    def _cut(self, cuts: list[int]) -> Runtime:
        """Cut a Sequential between its children."""
        strategy: Pipeline = self.strategy
        children = self._children_list
        ranges = chunk_ranges(cuts, len(children))
        owner = self._owner(len(ranges))
        owned = [s for s in range(len(ranges)) if owner[s] == strategy.pp_rank]
        keep_names = {children[i][0] for s in owned for i in ranges[s]}
        # the whole model's state layout (names, shapes, dtypes, which stage), for gathering it
        layout = []
        for s, r in enumerate(ranges):
            for i in r:
                name, child = children[i]
                for key, value in child.state_dict().items():
                    layout.append((f"{name}.{key}", s, tuple(value.shape), value.dtype))
        held = [{id(p) for i in r for p in children[i][1].parameters()} for r in ranges]
        left_out = [children[i][0] for s in owned for i in ranges[s] if on_meta(children[i][1])]
        if left_out:  # build_model and the cut disagree: never train a meta stage
            raise RuntimeError(f"pipeline: this process's children {left_out} were built without their parameters")
        for name, _ in children:
            if name not in keep_names:
                delattr(self, name)
        chunks = {s: nn.Sequential(OrderedDict((children[i][0], children[i][1]) for i in ranges[s]))
                  for s in owned}
        object.__setattr__(self, "_children_list", None)
        return self._install(chunks, owner, layout, [[children[i][0] for i in r] for r in ranges], held)

    def _cut_whole(self, x: Any, forward_fn: ForwardFn | None) -> Runtime:
        """Cut a model that is not a Sequential on the first micro-batch of ``x``: between its
        blocks when it runs a block list that hands one hidden state along, else by tracing."""
        strategy: Pipeline = self.strategy
        model = self._modules["model"]
        chunks = strategy.stages * strategy.virtual_stages
        example = first_rows(x, max(1, math.ceil(rows(x) / strategy.microbatches)))
        split, why_not = plan_blocks(model, example, forward_fn, chunks, strategy.split)
        if split is not None:
            return self._cut_blocks(split)
        return self._cut_traced(model, example, chunks, why_not)

    def _cut_blocks(self, split: BlockSplit) -> Runtime:
        owner = self._owner(split.chunks)
        owned = [c for c in range(split.chunks) if owner[c] == self.strategy.pp_rank]
        state = split.model.state_dict()
        layout = [(key, split.key_chunk[key], tuple(v.shape), v.dtype) for key, v in state.items()]
        del state
        split.keep(owned)  # the model stays this module's child, less the other processes' blocks
        stages: dict[int, nn.Module] = {c: BlockStage(split, c) for c in owned}
        names = [split.names(c) for c in range(split.chunks)]
        return self._install(stages, owner, layout, names, split.held, blocks=split)

    def _cut_traced(self, model: nn.Module, example: Any, chunks: int, why_not_blocks: str) -> Runtime:
        """Trace the model on ``example`` and keep this process's stages."""
        strategy: Pipeline = self.strategy
        try:
            args = as_args(example)
        except UsageError:
            raise UsageError(f"Expected a model that runs a block list (an nn.ModuleList of blocks, cut between "
                             f"them) or takes tensors (traced by torch.export) for strategy 'pipeline'; else strategy "
                             f"'allreduce' (the whole model on each process). Received: {type(model).__name__} "
                             f"({why_not_blocks or 'no nn.ModuleList of blocks'}) on {describe(example)}") from None
        points = split_points(model, args, chunks, strategy.split)
        was_training = model.training
        stages = trace_stages(model, args, points, chunks, why_not_blocks)
        owner = self._owner(chunks)
        layout = [(key, s, tuple(v.shape), v.dtype) for s, stage in enumerate(stages)
                  for key, v in stage.state_dict().items()]
        held = [{id(p) for p in stage.parameters()} for stage in stages]
        owned = {s: stages[s] for s in range(chunks) if owner[s] == strategy.pp_rank}
        delattr(self, "model")
        for s, stage in owned.items():
            self.add_module(f"stage{s}", stage.train(was_training))
        return self._install(owned, owner, layout, [[n] for n in ["(input)", *points]], held)

    def _owner(self, chunks: int) -> list[int]:
        _, _, style = SCHEDULES[self.strategy.schedule]
        return stage_ranks(chunks, self.strategy.stages, style)

    def _install(self, chunks: dict[int, nn.Module], owner: list[int], layout: Layout, names: list[list[str]],
                 held: list[set[int]], blocks: BlockSplit | None = None) -> Runtime:
        """The runtime over this process's ``chunks``; ``held``: the parameter ids every chunk trains
        (of every process: which parameters several processes share)."""
        from ._pipeline_runtime import Runtime, find_shared

        keep = {id(p) for c in chunks.values() for p in c.parameters()}
        kept, total = keep_stage_params(self.optimizer.inner, keep)
        self.optimizer._kept, self.optimizer._total = kept, total
        shared = find_shared(self._named, held, owner, self.strategy.pp_rank)
        object.__setattr__(self, "_named", None)
        runtime = Runtime(self.strategy, chunks, owner, layout, names, shared, blocks)
        object.__setattr__(self, "runtime", runtime)
        self.strategy.runtime = runtime
        return runtime

    def _ensure_cut(self, x: Any, forward_fn: ForwardFn | None = None) -> Runtime:
        if self.runtime is not None:
            return self.runtime
        if self.whole:
            return self._cut_whole(x, forward_fn)
        strategy: Pipeline = self.strategy
        children = self._children_list
        chunks = strategy.stages * strategy.virtual_stages
        cuts = None
        if strategy.env.rank == 0:  # one process measures; every process cuts alike
            b = max(1, math.ceil(rows(x) / strategy.microbatches))
            with torch.random.fork_rng(devices=[]):
                cuts = plan_cuts(children, chunks, "time", example=lambda: first_rows(x, b))
        cuts = comm.broadcast_object(cuts, 0, None)
        return self._cut(cuts)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The whole pipeline's output on every stage (evaluation, under ``torch.no_grad()``):
        ``model(x)``, ``model(x1, x2)`` or ``model(**inputs)``, as the model itself is called."""
        if torch.is_grad_enabled():
            raise UsageError("Expected strategy.train_step(...) to train a pipeline (or model(x) under "
                             "torch.no_grad() to evaluate). Received: model(x) with gradients enabled")
        if kwargs and args:
            raise UsageError(f"Expected model(x), model(x1, x2) or model(**inputs) for strategy 'pipeline'. "
                             f"Received: {len(args)} positional and {len(kwargs)} keyword arguments")
        inputs = kwargs if kwargs else args[0] if len(args) == 1 else args
        return self._ensure_cut(inputs).forward(inputs)


def pipeline_module(model: nn.Module) -> PipelineModule:
    """``model`` as `Pipeline.prepare` returned it (one line when it is something else)."""
    if not isinstance(model, PipelineModule):
        raise UsageError("Expected the model strategy.prepare returned for strategy 'pipeline'. "
                         f"Received: {type(model).__name__}")
    return model
