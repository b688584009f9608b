"""What runs one pipeline's stages in one process: torch's schedules (one per micro-batch size),
the loss on the last stage, the outputs sent to every stage, the gradients of parameters that
several stages train (tied weights), evaluation and gathering the model. Made by
`partrain.strategies._pipeline_module.PipelineModule` when it cuts the model.

A model cut between its blocks (`partrain.strategies._pipeline_blocks`) takes the batch's
inputs on every stage (as the keyword ``inputs``); the other cuts on the first stage only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage

from .. import comm
from .._tree import map_tensors
from ..batch import describe, primary
from ..errors import UsageError, error_line
from ..nn.split import SCHEDULES, as_args, rows
from ._pipeline_blocks import BlockSplit
from ._pipeline_wire import broadcast_output, broadcast_tensor, recv_tensors, send_tensors

if TYPE_CHECKING:
    from .pipeline import Pipeline


def _pad_rows(x: Any, index: torch.Tensor | None) -> Any:
    """``x`` with its rows (every tensor's first dimension, where it has the batch's) picked by ``index``."""
    if index is None:
        return x
    n = rows(x)
    return map_tensors(x, lambda t: t.index_select(0, index.to(t.device)) if t.dim() and t.shape[0] == n else t)


@dataclass
class SharedParam:
    """A parameter that several processes of one pipeline train (a weight tied across stages,
    such as an embedding and the output layer): its gradient is the sum of theirs."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    holders: list[int]  # pipeline ranks, ascending
    param: nn.Parameter | None  # this process's, None where it holds none


def find_shared(named: list[tuple[str, nn.Parameter]], chunk_params: list[set[int]], owner: list[int],
                pp_rank: int) -> list[SharedParam]:
    """The parameters (of the whole model, ``named`` in its order: the same on every process) that
    chunks of more than one process hold (``chunk_params``: ids per chunk)."""
    shared = []
    for name, p in named:
        holders = sorted({owner[c] for c, ids in enumerate(chunk_params) if id(p) in ids})
        if p.requires_grad and len(holders) > 1:
            shared.append(SharedParam(name, tuple(p.shape), p.dtype, holders, p if pp_rank in holders else None))
    return shared


class _FirstStage(nn.Module):
    """The first chunk, called the way the whole model is (``forward_fn(model, inputs)``)."""

    def __init__(self, chunk: nn.Module, runtime: Runtime) -> None:
        super().__init__()
        self.chunk = chunk
        object.__setattr__(self, "runtime", runtime)

    def forward(self, *args: Any) -> Any:
        fn = self.runtime.forward_fn
        inputs = args[0] if len(args) == 1 else args
        if fn is None:
            return self.chunk(*args)
        return fn(self.chunk, inputs)


class _Step:
    """What the last stage's loss needs during one schedule step, and what it collects."""

    def __init__(self, y: Any, n: int, loss_fn: Callable[[Any, Any], torch.Tensor], loss_scale: float) -> None:
        self.y, self.n, self.loss_fn, self.loss_scale = y, n, loss_fn, loss_scale
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: a micro-batch's forward pass has begun (before it, torch infers shapes)
        self.live = False


class Runtime:
    """The stages this process runs and the schedules that drive them (one per micro-batch size:
    torch fixes the shapes of what stages exchange at a schedule's first step)."""

    def __init__(self, strategy: Pipeline, chunks: dict[int, nn.Module], owner: list[int],
                 layout: list[tuple[str, int, tuple[int, ...], torch.dtype]], names: list[list[str]],
                 shared: list[SharedParam] | None = None, blocks: BlockSplit | None = None) -> None:
        self.strategy = strategy
        self.chunks = chunks
        self.owned = sorted(chunks)
        self.owner = owner
        self.num_chunks = len(owner)
        self.layout = layout
        self.names = names  # the children of each chunk, by name
        self.forward_fn: Callable[[nn.Module, Any], Any] | None = None
        self.step: _Step | None = None
        self.schedules: dict[int, Any] = {}
        self.out_meta: tuple[tuple[int, ...], torch.dtype] | None = None
        self.shared = shared or []
        #: ids of shared parameters that a lower pipeline rank counts in the whole model's gradient norm
        self.counted_elsewhere = {id(sp.param) for sp in self.shared
                                  if sp.param is not None and sp.holders[0] != strategy.pp_rank}
        self.blocks = blocks
        self.first = _FirstStage(chunks[0], self) if 0 in chunks and blocks is None else None
        #: the other stages' layers were given back to the system (at the first step)
        self.trimmed = False

    def parameters(self) -> list[nn.Parameter]:
        return [p for s in self.owned for p in self.chunks[s].parameters()]

    def module_of(self, s: int) -> nn.Module:
        return self.first if s == 0 and self.first is not None else self.chunks[s]

    def pp_global(self, chunk: int) -> int:
        return self.strategy.pp_ranks[self.owner[chunk]]

    # -- training ------------------------------------------------------------------------
    def schedule_for(self, b: int) -> Any:
        if b in self.schedules:
            return self.schedules[b]
        strategy = self.strategy
        cls_name, multi, _ = SCHEDULES[strategy.schedule]
        cls = getattr(pipelining.schedules, cls_name)
        stages = [_TimedStage(self.module_of(s), s, self.num_chunks, strategy.device, group=strategy.pp_group,
                              clock=strategy, runtime=self) for s in self.owned]
        try:
            schedule = cls(stages if multi else stages[0], n_microbatches=strategy.microbatches,
                           loss_fn=self.loss, scale_grads=False)
        except (ValueError, AssertionError, RuntimeError) as exc:
            raise UsageError(f"Expected options schedule {strategy.schedule!r} accepts (stages={strategy.stages}, "
                             f"microbatches={strategy.microbatches}, virtual_stages={strategy.virtual_stages}). "
                             f"Received: {error_line(exc)}") from None
        self.schedules[b] = schedule
        return schedule

    def loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch: ``index`` holds its rows of the padded batch;
        rows past the real ``n`` are padding and left out."""
        start = time.perf_counter()
        step = self.step
        if self.blocks is not None:
            output = self.blocks.structure(output)
        if step is None or not step.live:
            # torch's shape inference (a schedule's first step) calls the loss on a forward pass of
            # its own, before any micro-batch: a loss with the right graph, and nothing recorded
            return (primary(output) * 0).sum()
        first = int(index[0])
        k = max(0, min(len(index), step.n - first))
        if k == 0:
            loss = (primary(output) * 0).sum()
        else:
            if k == len(index):
                out = output
            elif isinstance(output, torch.Tensor):
                out = output[:k]
            else:  # a loss the model computed (Hugging Face's) already counts the padding rows
                raise UsageError(f"Expected the model to return one tensor (forward_fn=lambda m, x: m(**x).logits "
                                 f"and a named loss) or batches that divide into {self.strategy.microbatches} "
                                 f"micro-batches, for strategy 'pipeline' (it pads the others with rows it drops "
                                 f"from the output). Received: {describe(output)} on a batch of {step.n}")
            target = step.y[first:first + k] if isinstance(step.y, torch.Tensor) else _slice(step.y, first, k)
            per_sample = step.loss_fn(out, target)
            step.outputs[first] = (primary(out).detach(), per_sample.detach())
            loss = per_sample.sum() * step.loss_scale
        self.strategy.compute_seconds += time.perf_counter() - start
        return loss

    def run(self, x: Any, y: Any, n: int, loss_fn: Callable[[Any, Any], torch.Tensor], loss_scale: float,
            forward_fn: Callable[[nn.Module, Any], Any] | None) -> tuple[Any, torch.Tensor]:
        strategy = self.strategy
        m = strategy.microbatches
        b = math.ceil(n / m)
        padded = b * m
        # pad with copies of real samples (their losses are dropped): every micro-batch the same size
        pad = None if padded == n else torch.arange(padded) % n
        self.forward_fn = forward_fn
        self.step = _Step(y, n, loss_fn, loss_scale)
        schedule = self.schedule_for(b)
        kwargs: dict[str, Any] = {}
        if self.num_chunks - 1 in self.chunks:
            kwargs["target"] = torch.arange(padded, device=strategy.device)
            kwargs["losses"] = []
        if self.blocks is not None:  # every stage runs the model's forward on the batch's inputs
            self.blocks.forward_fn = forward_fn
            args: tuple[Any, ...] = ()
            kwargs["inputs"] = _pad_rows(x, pad)
        else:
            as_args(x)  # on every stage (each has the batch): a bad input fails all of them alike, not one
            args = as_args(_pad_rows(x, pad)) if 0 in self.chunks else ()
        compute_before = strategy.compute_seconds
        start = time.perf_counter()
        try:
            schedule.step(*args, return_outputs=False, **kwargs)
        except Exception as exc:
            cause: BaseException | None = exc
            while cause is not None and not isinstance(cause, UsageError):  # torch wraps a stage's errors
                cause = cause.__cause__
            if cause is not None:
                raise cause from None
            raise RuntimeError(self.failure(exc)) from exc
        finally:
            if self.blocks is not None:
                self.blocks.forward_fn = None
        wall = time.perf_counter() - start
        strategy.step_seconds += wall
        waited = max(0.0, wall - (strategy.compute_seconds - compute_before))
        strategy.bubble_seconds += waited
        strategy.comm_seconds += waited
        step, self.step = self.step, None
        return self.share_output(step)

    def failure(self, exc: BaseException) -> str:
        s = self.strategy
        here = ", ".join(str(c) for c in self.owned)
        neighbours = sorted({self.owner[c + d] for c in self.owned for d in (-1, 1)
                             if 0 <= c + d < self.num_chunks and self.owner[c + d] != s.pp_rank})
        peers = ", ".join(f"stage {r} (rank {s.pp_ranks[r]})" for r in neighbours)
        return (f"pipeline stage {s.pp_rank} (rank {s.env.rank}, chunks {here}): a step with {peers} failed "
                f"(a neighbour died or timed out?): {error_line(exc)}")

    def share_output(self, step: _Step) -> tuple[Any, torch.Tensor]:
        """The last stage's outputs and per-sample losses, in sample order, on every stage."""
        strategy = self.strategy
        out = per_sample = None
        if step.outputs:
            parts = [step.outputs[k] for k in sorted(step.outputs)]
            if all(isinstance(o, torch.Tensor) for o, _ in parts):
                out = torch.cat([o for o, _ in parts])
            per_sample = torch.cat([p for _, p in parts])
        last = self.pp_global(self.num_chunks - 1)
        if strategy.stages > 1:
            start = time.perf_counter()
            out = broadcast_tensor(out, last, strategy.pp_group, strategy.env.rank,
                                    "the last stage's output (the pipeline needs a model returning one tensor)",
                                    strategy.device)
            per_sample = broadcast_tensor(per_sample, last, strategy.pp_group, strategy.env.rank, "the losses",
                                           strategy.device)
            strategy.comm_seconds += time.perf_counter() - start
        elif out is None:
            raise UsageError("Expected a model returning one tensor for strategy 'pipeline'. Received: "
                             f"{describe(parts[0][0])}")
        self.out_meta = (tuple(out.shape[1:]), out.dtype)
        return out, per_sample

    def sum_shared_grads(self) -> None:
        """Each parameter that several processes train (`SharedParam`) gets the sum of their
        gradients on each of them, as one process accumulates its uses (before the step: every
        holder then steps it alike and the copies stay equal)."""
        strategy = self.strategy
        for sp in self.shared:
            p = sp.param
            grad = (p.grad if p is not None and p.grad is not None else
                    torch.zeros(sp.shape, dtype=sp.dtype, device=strategy.device))
            start = time.perf_counter()
            comm.all_reduce_sum(grad, strategy.pp_group)
            strategy.comm_seconds += time.perf_counter() - start
            strategy.comm_bytes += grad.numel() * grad.element_size()
            if p is not None:
                p.grad = grad

    def empty_output(self) -> torch.Tensor:
        shape, dtype = self.out_meta or ((), torch.float32)
        return torch.zeros((0, *shape), dtype=dtype, device=self.strategy.device)

    # -- evaluation --------------------------------------------------------------------
    def forward(self, inputs: Any) -> Any:
        """The whole model's output on every stage (evaluation, no gradients).

        The batch goes through in ``microbatches`` pieces (uneven ones are fine: every message
        says its shape), each through every chunk in order; a process moves on to the next
        piece once it sent the last one on, so the stages overlap as in a forward-only GPipe.
        """
        strategy = self.strategy
        last = self.pp_global(self.num_chunks - 1)
        me = strategy.env.rank
        if self.blocks is not None:  # one piece: the output can be any structure (a Hugging Face ModelOutput)
            out = self.forward_piece((), inputs)
            return broadcast_output(out if me == last else None, last, strategy.pp_group, me, strategy.device)
        args = as_args(inputs)
        pieces = max(1, min(strategy.microbatches, int(args[0].shape[0]) if args[0].dim() else 1))
        chunks_of = [a.tensor_split(pieces) if a.dim() else [a] * pieces for a in args]
        outputs = [self.forward_piece(tuple(c[j] for c in chunks_of)) for j in range(pieces)]
        out = None
        if me == last:
            out = torch.cat(outputs) if all(isinstance(o, torch.Tensor) for o in outputs) else outputs[0]
        return broadcast_tensor(out, last, strategy.pp_group, me, "the model's output", strategy.device)

    def forward_piece(self, args: tuple[Any, ...], inputs: Any = None) -> Any:
        """One piece through this process's chunks, receiving and sending between them
        (``inputs``: the batch's, for every chunk of a model cut between its blocks)."""
        strategy = self.strategy
        group = strategy.pp_group
        x: Any = None
        every = {} if self.blocks is None else {"inputs": inputs}
        for s in range(self.num_chunks):
            if self.owner[s] != strategy.pp_rank:
                continue
            if s == 0:
                x = self.module_of(0)(*args, **every)
            else:
                if self.owner[s - 1] != strategy.pp_rank:
                    x = recv_tensors(self.pp_global(s - 1), group, strategy.device)
                x = self.chunks[s](*as_args(x), **every)
            if self.blocks is not None and s == self.num_chunks - 1:
                x = self.blocks.structure(x)
            if s + 1 < self.num_chunks and self.owner[s + 1] != strategy.pp_rank:
                try:
                    sent = as_args(x)
                except UsageError:
                    raise UsageError(f"Expected tensors between pipeline stages. Received: {describe(x)} "
                                     f"after {self.names[s][-1]!r}") from None
                send_tensors(sent, self.pp_global(s + 1), group, strategy.device)
        return x

    # -- checkpoints -------------------------------------------------------------------
    def gather_state(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters and buffers on this pipeline's first stage, in the whole model's order."""
        strategy = self.strategy
        own: dict[str, torch.Tensor] = {}
        for s in self.owned:
            own.update(self.chunks[s].state_dict())
        if strategy.stages == 1:
            return own
        first = strategy.pp_ranks[0]
        state: dict[str, torch.Tensor] = {}
        for key, s, shape, dtype in self.layout:
            src = self.pp_global(s)
            if src == first:
                if strategy.env.rank == first:
                    state[key] = own[key]
            elif strategy.env.rank == src:
                dist.send(own[key].detach().contiguous(), dst=first, group=strategy.pp_group)
            elif strategy.env.rank == first:
                t = torch.empty(shape, dtype=dtype, device=strategy.device)
                dist.recv(t, src=src, group=strategy.pp_group)
                state[key] = t
        return state if strategy.env.rank == first else own


def _slice(obj: Any, first: int, k: int) -> Any:
    return map_tensors(obj, lambda t: t[first:first + k])


class _TimedStage(PipelineStage):
    """A stage that adds the seconds of its forward and backward passes to ``clock.compute_seconds``
    (the rest of a step is the bubble: waiting for neighbours)."""

    def __init__(self, *args: Any, clock: Pipeline, runtime: Runtime, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self.runtime = runtime

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        if self.runtime.step is not None:
            self.runtime.step.live = True
        start = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.clock.compute_seconds += time.perf_counter() - start

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.clock.compute_seconds += time.perf_counter() - start

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
        finally:
            self.clock.compute_seconds += time.perf_counter() - start
