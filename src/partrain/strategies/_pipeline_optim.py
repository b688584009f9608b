"""One optimizer over a model whose parameters are spread over pipeline stages.

Each stage steps only its own parameters (the user's optimizer with the other stages'
parameters taken out of its groups, which stay, possibly empty, so learning-rate
schedulers and per-group settings see the same groups everywhere). Its state dict is the
one the whole model's optimizer would have in one process: parameters numbered across all
stages, in the order the user's optimizer listed them, so a pipeline's checkpoint loads
under ``single`` or ``allreduce`` and theirs under a pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..errors import UsageError
from ._wrapped_optim import WrappedOptimizer


class StageOptimizer(WrappedOptimizer):
    """The user's optimizer restricted to this stage's parameters, with a whole-model state dict.

    ``state_dict()`` is collective over the pipeline's processes (every stage calls it;
    the first stage receives the others' states and returns the whole-model dict, the
    others return their own part in the same numbering). ``load_state_dict`` takes a
    whole-model dict and keeps this stage's part (no communication).
    """

    strategy_name = "pipeline"

    def __init__(self, inner: Optimizer, kept: list[list[int]], total: list[int],
                 gather: Callable[[dict[str, Any]], list[dict[str, Any]] | None]) -> None:
        super().__init__(inner)
        self._kept = kept  # per group: global indices (within the group) of the parameters kept here
        self._total = total  # per group: parameters of the whole model's optimizer
        self._gather = gather

    def _offsets(self) -> list[int]:
        offsets, start = [], 0
        for n in self._total:
            offsets.append(start)
            start += n
        return offsets

    def local_state_dict(self) -> dict[str, Any]:
        """This stage's state in the whole model's numbering."""
        local = self.inner.state_dict()
        offsets = self._offsets()
        state: dict[int, Any] = {}
        groups = []
        for g, (group, kept) in enumerate(zip(local["param_groups"], self._kept)):
            global_ids = [offsets[g] + i for i in kept]
            for local_id, global_id in zip(group["params"], global_ids):
                if local_id in local["state"]:
                    state[global_id] = local["state"][local_id]
            groups.append({**group, "params": global_ids})
        return {"state": state, "param_groups": groups}

    @property
    def is_cut(self) -> bool:
        """False until the model is cut (``split="time"`` waits for a batch): until then the
        inner optimizer holds every parameter, numbered as one process numbers them."""
        return bool(self._total)

    def state_dict(self) -> dict[str, Any]:
        if not self.is_cut:
            return self.inner.state_dict()
        own = self.local_state_dict()
        parts = self._gather(own)
        if parts is None:
            return own
        state: dict[int, Any] = {}
        for part in parts:
            state.update(part["state"])
        offsets = self._offsets()
        groups = [{**group, "params": list(range(offsets[g], offsets[g] + self._total[g]))}
                  for g, group in enumerate(own["param_groups"])]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self.is_cut:
            self.inner.load_state_dict(state_dict)
            return
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != self._total:
            raise UsageError(f"Expected an optimizer state with {len(self._total)} groups of "
                             f"{self._total} parameters (the whole model's). Received: groups of "
                             f"{[len(g['params']) for g in groups]}")
        local_groups, local_state = [], {}
        next_id = 0
        for group, kept in zip(groups, self._kept):
            ids = []
            for i in kept:
                global_id = group["params"][i]
                if global_id in state_dict["state"]:
                    local_state[next_id] = state_dict["state"][global_id]
                ids.append(next_id)
                next_id += 1
            local_groups.append({**group, "params": ids})
        self.inner.load_state_dict({"state": local_state, "param_groups": local_groups})


def keep_stage_params(optimizer: Optimizer, keep: set[int]) -> tuple[list[list[int]], list[int]]:
    """Take every parameter whose ``id`` is not in ``keep`` out of ``optimizer``'s groups.

    Returns, per group, the indices (within the group) of the parameters kept, and the
    group sizes before.
    """
    kept, total = [], []
    for group in optimizer.param_groups:
        params = group["params"]
        total.append(len(params))
        idx = [i for i, p in enumerate(params) if id(p) in keep]
        kept.append(idx)
        group["params"] = [params[i] for i in idx]
    for p in list(optimizer.state):
        if id(p) not in keep:
            del optimizer.state[p]
    return kept, total


def send_object(obj: Any, dst: int, group: Any) -> None:
    """An object to one rank of the job (pickled between the job's own processes only)."""
    dist.send_object_list([obj], dst=dst, group=group, device=torch.device("cpu"))


def recv_object(src: int, group: Any) -> Any:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group, device=torch.device("cpu"))
    return box[0]
