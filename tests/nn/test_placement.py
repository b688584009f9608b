"""partrain.nn.place: layers on several devices of one process compute what the unplaced model does.

The reference is the same model, unplaced, in float64: outputs, gradients and a few SGD
steps must agree exactly (the same kernels in the same order; only copies between
devices are added). Without CUDA the "devices" are CPU ones, so the tests check the
bookkeeping (which child sits where, names, the device each chunk's input arrives on)
rather than a transfer between memories.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from partrain.errors import UsageError
from partrain.models import mlp
from partrain.nn import PlacedSequential, place


def model64() -> nn.Module:
    torch.manual_seed(0)
    return mlp(in_features=12, hidden=8, depth=3).double()


def test_placed_model_trains_exactly_like_the_unplaced_one():
    reference = model64()
    placed = place(copy.deepcopy(reference), "5", ["cpu", "cpu:0"])
    assert isinstance(placed, PlacedSequential)
    assert [names for _, names in placed.placement] == [["0", "1", "2", "3", "4"], ["5", "6", "7"]]
    assert placed.state_dict().keys() == reference.state_dict().keys()  # checkpoints load either way
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt_placed = torch.optim.SGD(placed.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(7, 12, generator=g, dtype=torch.float64)
        for model, opt in ((reference, opt_ref), (placed, opt_placed)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        assert torch.equal(placed(x), reference(x))
    for (name, p), q in zip(placed.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


def test_activations_enter_each_chunk_on_its_device():
    """Each chunk's first child receives its input on the chunk's device (hooks see the tensors)."""
    placed = place(model64(), ["3"], ["cpu", "cpu"], output_device="cpu")
    seen = {}
    for name in ("0", "3"):
        placed.get_submodule(name).register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, args[0].device))
    placed(torch.zeros(2, 12, dtype=torch.float64))
    assert seen == {"0": torch.device("cpu"), "3": torch.device("cpu")}
    assert placed.device_of("7") == torch.device("cpu")


def test_balanced_split_by_parameters():
    placed = place(model64(), devices=["cpu", "cpu"])
    # Linear layers of 12*8+8=104, 72, 72 and 8*10+10=90 parameters: 104+72 | 72+90 beats
    # 104 | 234 and 248 | 90; of the equal cuts (before ReLU "4" or Linear "5") the first
    assert [names for _, names in placed.placement] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]


@pytest.mark.parametrize("args, line", [
    ((nn.Linear(2, 2), "params", ["cpu"]), "Expected an nn.Sequential model for partrain.nn.place"),
    ((None, "params", ["cuda:7"]), r"Expected a device this machine has \(\d+ CUDA device"),
    ((None, "params", ["tpu:0"]), "Expected a device such as 'cpu' or 'cuda:0'. Received: 'tpu:0'"),
    ((None, "fc9", ["cpu", "cpu"]), "Expected split points among the model's children"),
    ((None, "params", ["cpu"] * 5), "Expected at least 5 top-level children with parameters"),
    ((None, "params", []), "Expected at least one device"),
])
def test_bad_input_is_one_line(args, line):
    model, split, devices = args
    with pytest.raises(UsageError, match=line):
        place(model if model is not None else model64(), split, devices)
