"""Checkpoints served without a second copy, and stages that read only their own weights (issue 56, item 4).

What it guards: ``partrain serve`` rebuilds a checkpoint's model on the meta device and
gives it the checkpoint's tensors as they map the file, so a served model is held once
(not a randomly initialised copy plus the loaded weights); ``--stages`` cuts that empty
model and each stage reads only its own run of layers. Answers must be those of the model
built and loaded the ordinary way, and a model that cannot be rebuilt from its state dict
on the meta device (a buffer outside the state dict) must still load, the ordinary way.
Start with `test_a_stage_reads_only_its_own_weights`.
"""

from __future__ import annotations

import torch
from torch import nn

from partrain.checkpoint import save_checkpoint
from partrain.serve.checkpoints import model_from_checkpoint
from partrain.serve.stages import cut, own_part


def layered(width: int = 8, layers: int = 6) -> nn.Sequential:
    """Module-level: the checkpoint's spec names it (``tests.serve.test_lazy_loading:layered``)."""
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width, dtype=torch.float64), nn.Tanh()]
    return nn.Sequential(*blocks)


class WithTable(nn.Module):
    """A buffer outside the state dict (``persistent=False``), computed at construction."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)
        self.register_buffer("table", torch.arange(4, dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.table


def with_table() -> nn.Module:
    return WithTable()


def write(tmp_path, name: str, model: nn.Module, kwargs: dict | None = None) -> str:  # noqa: ANN001
    path = str(tmp_path / f"{name}.pt")
    save_checkpoint(path, {"model": model.state_dict(),
                           "model_spec": {"name": f"tests.serve.test_lazy_loading:{name}", "kwargs": kwargs or {}}})
    return path


def test_a_served_checkpoint_holds_the_checkpoints_tensors_once(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    trained = layered()
    path = write(tmp_path, "layered", trained)
    model, _ = model_from_checkpoint(path)
    assert not any(p.is_meta for p in model.parameters())
    x = torch.randn(5, 8, dtype=torch.float64)
    assert torch.equal(model(x), trained(x))
    # every tensor is the checkpoint's (no randomly initialised one left behind)
    loaded = torch.load(path, mmap=True, weights_only=True)["model"]
    assert all(torch.equal(p, loaded[k]) for k, p in model.state_dict().items())


def test_a_stage_reads_only_its_own_weights(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(1)
    trained = layered()
    path = write(tmp_path, "layered", trained)
    model, _ = model_from_checkpoint(path, weights=False)
    assert all(p.is_meta for p in model.parameters())  # nothing held before the cut
    chunks, pre = cut(model, 2)
    assert pre is None
    second = own_part(chunks[1], path)
    assert not any(p.is_meta for p in second.parameters())
    assert all(p.is_meta for p in chunks[0].parameters())  # the other stage's part was never read
    first = own_part(chunks[0], path)
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(second(first(x)), trained(x))


def test_a_model_with_a_buffer_outside_its_state_dict_loads_the_ordinary_way(tmp_path) -> None:  # noqa: ANN001
    torch.manual_seed(2)
    trained = WithTable()
    path = write(tmp_path, "with_table", trained)
    for weights in (True, False):  # even when the caller asked to read the weights later
        model, _ = model_from_checkpoint(path, weights=weights)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        x = torch.randn(2, 4, dtype=torch.float64)
        assert torch.equal(model(x), trained(x))
