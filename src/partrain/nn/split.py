"""Where a model is cut into pipeline stages, and which process runs each stage.

Plain functions, no communication: the strategy (`partrain.strategies.pipeline`) and
`partrain.nn.place` both use them.

Vocabulary: a model's *children* are its top-level modules, which must run one after
the other (an ``nn.Sequential``); a *chunk* is a run of consecutive children, one per
pipeline stage; *cuts* are the child indices where chunks 1, 2, ... begin.
"""

from __future__ import annotations

import ctypes
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .._tree import map_tensors
from ..batch import batch_size, describe
from ..errors import UsageError

#: how a model is cut when no names are given
BALANCE = ("params", "time")


def sequential_children(model: nn.Module, what: str = "strategy 'pipeline'") -> list[tuple[str, nn.Module]]:
    """The ``(name, module)`` children of an ``nn.Sequential``, in order (one line when not one).

    Only a Sequential promises that its forward pass is its children applied in order;
    cutting any other module between its children could silently compute something else.
    """
    if not isinstance(model, nn.Sequential):
        raise UsageError(f"Expected an nn.Sequential model for {what} (its children run in order and are "
                         f"cut between stages; wrap your layers in one). Received: {type(model).__name__}")
    return list(model.named_children())


def balance(costs: Sequence[float], chunks: int, has_params: Sequence[bool] | None = None) -> list[int]:
    """Cuts that split ``costs`` (one per child) into ``chunks`` contiguous runs, none empty,
    minimising the largest run's total (the slowest stage bounds a pipeline's throughput).
    With ``has_params``, every run holds at least one child that has parameters.

    Exact dynamic programme over the children (a model has tens of them, not thousands).
    """
    n = len(costs)
    owns = [0]
    for flag in (has_params if has_params is not None else [True] * n):
        owns.append(owns[-1] + int(bool(flag)))
    if not 1 <= chunks <= n:
        raise UsageError(f"Expected at most one stage per top-level child: {chunks} stages for {n} children. "
                         f"Received: a model with {n} children")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest largest-run total splitting children[:i] into k runs
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for k in range(1, chunks + 1):
        for i in range(k, n - (chunks - k) + 1):
            for j in range(k - 1, i):
                if owns[i] == owns[j]:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[chunks][n] == inf:
        raise UsageError(f"Expected at least {chunks} top-level children with parameters to cut into {chunks} "
                         f"stages (a stage without parameters breaks torch's zero-bubble schedules). "
                         f"Received: {owns[-1]}")
    cuts, i = [], n
    for k in range(chunks, 0, -1):
        i = cut[k][i]
        cuts.append(i)
    return sorted(cuts)[1:]  # the first run starts at 0


def cuts_by_names(names: Sequence[str], split_points: Sequence[str], chunks: int) -> list[int]:
    """Cuts where the named children begin a new stage (``split="4,8"``)."""
    if len(split_points) != chunks - 1:
        raise UsageError(f"Expected {chunks - 1} split point{'s' * (chunks != 2)} (child names where a stage "
                         f"begins) for {chunks} stages. Received: {list(split_points)}")
    cuts = []
    for point in split_points:
        if point not in names:
            raise UsageError(f"Expected split points among the model's children {list(names)}. "
                             f"Received: {point!r}")
        cuts.append(names.index(point))
    if cuts != sorted(set(cuts)) or cuts[0] == 0:
        raise UsageError(f"Expected increasing split points after the first child {names[0]!r}. "
                         f"Received: {list(split_points)}")
    return cuts


def parameter_costs(children: Sequence[tuple[str, nn.Module]]) -> list[float]:
    """Parameters per child."""
    return [float(sum(p.numel() for p in m.parameters())) for _, m in children]


def check_stages_hold_parameters(children: Sequence[tuple[str, nn.Module]], cuts: Sequence[int]) -> None:
    """One line naming a stage without parameters (torch's split backward leaves the next
    stage's gradients unset behind one)."""
    for s, r in enumerate(chunk_ranges(cuts, len(children))):
        if not any(p.requires_grad for i in r for p in children[i][1].parameters()):
            names = ", ".join(children[i][0] for i in r)
            raise UsageError(f"Expected every pipeline stage to hold parameters. Received: stage {s} "
                             f"(children {names}) has none; move its split point")


def time_costs(children: Sequence[tuple[str, nn.Module]], example: Any, repeats: int = 3) -> list[float]:
    """Measured forward-and-backward seconds of each child on ``example`` (the best of ``repeats``)."""
    costs = []
    x = example
    for _, module in children:
        best = float("inf")
        out = None
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
            start = time.perf_counter()
            out = module(inp)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.sum().backward()
            best = min(best, time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
        costs.append(best)
        x = out.detach() if isinstance(out, torch.Tensor) else out
    return costs


def plan_cuts(children: Sequence[tuple[str, nn.Module]], chunks: int, split: str,
              example: Callable[[], Any] | None = None) -> list[int]:
    """The cuts for ``split``: ``"params"``, ``"time"`` (``example()`` gives a batch) or child names."""
    names = [n for n, _ in children]
    if chunks > len(children):
        raise UsageError(f"Expected at least {chunks} top-level children to cut into {chunks} stages. "
                         f"Received: a model with {len(children)} ({', '.join(names)})")
    has_params = [any(p.requires_grad for p in m.parameters()) for _, m in children]
    if split == "params":
        return balance(parameter_costs(children), chunks, has_params)
    if split == "time":
        if example is None:
            raise UsageError("Expected an example batch to time the children for split='time'. Received: none")
        return balance(time_costs(children, example()), chunks, has_params)
    points = [p.strip() for p in str(split).split(",") if p.strip()]
    if not points and chunks > 1:
        raise UsageError(f"Expected split among {list(BALANCE)} or child names where stages begin. "
                         f"Received: {split!r}")
    cuts = cuts_by_names(names, points, chunks)
    check_stages_hold_parameters(children, cuts)
    return cuts


def chunk_ranges(cuts: Sequence[int], n: int) -> list[range]:
    """The child indices of each chunk."""
    bounds = [0, *cuts, n]
    return [range(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def stage_ranks(chunks: int, ranks: int, style: str) -> list[int]:
    """The pipeline rank that runs each chunk: ``"loop"`` (chunk s on rank s mod p: GPipe, 1F1B,
    interleaved) or ``"v"`` (rank r runs chunks r and 2p-1-r: ZBV, DualPipeV)."""
    if style == "v":
        return [s if s < ranks else 2 * ranks - 1 - s for s in range(chunks)]
    return [s % ranks for s in range(chunks)]


# ----- batches and schedules (no torch.distributed.pipelining here: importing it costs
# seconds of CPU, paid only by a process that runs a pipeline) -----------------------------

#: schedule name -> (torch class name, stages per process > 1, placement style)
SCHEDULES: dict[str, tuple[str, bool, str]] = {
    "gpipe": ("ScheduleGPipe", False, "loop"),
    "1f1b": ("Schedule1F1B", False, "loop"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", True, "loop"),
    "loopedbfs": ("ScheduleLoopedBFS", True, "loop"),
    "interleavedzerobubble": ("ScheduleInterleavedZeroBubble", True, "loop"),
    "zbvzerobubble": ("ScheduleZBVZeroBubble", True, "v"),
    "dualpipev": ("ScheduleDualPipeV", True, "v"),
}


def give_back_freed_memory() -> None:
    """Return the other stages' layers, just freed, to the system (glibc keeps freed heap memory
    up to a high trim threshold, which partrain's workers set for speed: `tune_allocator`)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def rows(x: Any) -> int:
    """The samples in a batch's inputs (a tensor, or tensors in tuples and dicts)."""
    return batch_size(x)


def first_rows(x: Any, b: int) -> Any:
    """The first ``b`` samples of a batch's inputs (tensors without a batch dimension kept whole)."""
    n = rows(x)
    return map_tensors(x, lambda t: t[:b] if t.dim() and t.shape[0] == n else t)


def as_args(x: Any) -> tuple[Any, ...]:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise UsageError(f"Expected a tensor or a tuple of tensors as the model's inputs for strategy 'pipeline'. "
                     f"Received: {describe(x)}")
