"""The shell of an optimizer that steps the user's optimizer for a strategy holding part of
the model (`StageOptimizer`: a pipeline stage's parameters; `ShardedOptimizer`: fsdp's shards).

It shares the user's optimizer's ``param_groups`` and ``state`` (not copies: a learning-rate
scheduler, fit's warm-up and the user's code change the rates there), delegates ``step`` and
``zero_grad``, and refuses new parameter groups after ``prepare``. Subclasses add the
whole-model state dict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

from torch.optim import Optimizer

from ..errors import UsageError


class WrappedOptimizer(Optimizer):
    #: the strategy's name, for the one line that refuses ``add_param_group``
    strategy_name: ClassVar[str] = ""

    def __init__(self, inner: Optimizer) -> None:
        # Optimizer.__init__ would copy the groups; sharing them is the point
        self.inner = inner
        self.defaults = inner.defaults
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                     "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())

    # the inner optimizer's, always: its load_state_dict replaces its lists
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self.inner.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        return self.inner.step(closure) if closure is not None else self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UsageError("Expected the optimizer's parameter groups to be complete before strategy.prepare for "
                         f"strategy '{self.strategy_name}'. Received: add_param_group afterwards")
