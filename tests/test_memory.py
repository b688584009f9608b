"""The run's memory figures (`partrain.memory`): state and activations counted by hand.

What is guarded: each process's bytes of parameters, gradients and optimizer state are
the tensors it holds (a whole model under ``allreduce``, half of it per worker under
``fsdp``: the hand count of `small_mlp64` halves exactly), activations are the bytes autograd
saves for the backward with the parameters left out (a two-layer example counted by hand,
and the same under ``fsdp`` as under ``allreduce`` at the same per-worker batch: sharding
moves parameters, not activations), and the run's rows and epoch line carry them for every
process. Start with `test_activation_bytes_counted_by_hand`.
"""

import math

import pytest
import torch
from torch import nn

from partrain.memory import (
    ActivationMeter,
    MemoryMeter,
    human_bytes,
    per_rank,
    state_bytes,
    summary,
)
from partrain.train.fit import fit
from partrain.train.report import summary as epoch_line
from tests.helpers import digits64, small_mlp64

N_PARAMS = 64 * 32 + 32 + 32 * 10 + 10  # small_mlp64
S64 = N_PARAMS * 8


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def test_activation_bytes_counted_by_hand():
    """``relu(Linear(4, 3)(x)).sum()`` on 5 samples saves x (5 x 4) for the weight's gradient and
    relu's output (5 x 3); the weight (saved transposed, a view of the parameter) is no activation."""
    layer = nn.Linear(4, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    meter = ActivationMeter(exclude=layer.parameters())
    with meter.counting():
        loss = torch.relu(layer(x)).sum()
    assert meter.bytes == 5 * 4 * 8 + 5 * 3 * 8
    loss.backward()  # the hooks handed autograd its tensors back unchanged
    expected = (torch.relu(x @ layer.weight.detach().T + layer.bias.detach()) > 0).double().T @ x
    assert torch.allclose(layer.weight.grad, expected)


def test_shared_storage_counts_once_and_no_grad_counts_nothing():
    x = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    meter = ActivationMeter()
    with meter.counting():
        y = x * 2  # saves nothing of size (a scalar factor)
        z = (y.exp() * y.exp()).sum()  # each exp saves its result: two storages
    assert meter.bytes == 2 * 36 * 8
    with torch.no_grad(), meter.counting():
        (x.exp() * 3).sum()
    assert meter.bytes == 2 * 36 * 8
    z.backward()


def test_state_bytes_by_hand_after_an_adam_step():
    model = small_mlp64()
    optimizer = adam(model.parameters())
    assert state_bytes(model, optimizer) == {"params": S64, "grads": S64, "optimizer": 0}
    model(torch.randn(3, 64, dtype=torch.float64)).sum().backward()
    optimizer.step()
    steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    assert state_bytes(model, optimizer) == {"params": S64, "grads": S64, "optimizer": 2 * S64 + steps}
    model[1].weight.requires_grad_(False)  # a frozen parameter has no gradient (model[0]: Flatten)
    assert state_bytes(model, optimizer)["grads"] == S64 - 64 * 32 * 8


def test_meta_parameters_hold_nothing():
    with torch.device("meta"):
        model = nn.Linear(100, 100)
    assert state_bytes(model) == {"params": 0, "grads": 0, "optimizer": 0}


def test_rows_take_the_largest_process_and_keep_each():
    ranks = [{"params": 10.0, "grads": 10.0, "optimizer": 20.0, "activations": 5.0, "peak": 1e9},
             {"params": 8.0, "grads": 8.0, "optimizer": 16.0, "activations": math.nan, "peak": 2e9}]
    row = per_rank(ranks)
    assert row["memory_params"] == 10.0 and row["memory_peak"] == 2e9 and row["memory_activations"] == 5.0
    assert row["memory_ranks"] == ranks
    assert summary(row) == "  mem/rank state 40B (p 10B g 10B opt 20B) act 5B peak rss 2.0GB"
    assert human_bytes(1234567) == "1.2MB" and human_bytes(math.nan) == "?"
    assert summary({}) == ""


def test_meter_watches_the_first_step_only():
    model = nn.Linear(4, 4).double()
    meter = MemoryMeter(torch.device("cpu"))
    for n in (3, 7):
        with meter.watch(model):
            model(torch.randn(n, 4, dtype=torch.float64)).pow(2).sum().backward()
    # the input (3 x 4, for the weight's gradient) and the output (3 x 4, for pow's)
    assert meter.activations == 2 * 3 * 4 * 8
    figures = meter.figures(model, None)
    assert figures["params"] == figures["grads"] == (16 + 4) * 8 and figures["peak"] > 0
    assert "cuda_peak" not in figures


def run(strategy):
    return fit(small_mlp64, digits64, adam, strategy=strategy, workers=2, batch_size=48, epochs=1,
               max_steps=2, quiet=True, return_state=False)


def test_fsdp_holds_half_of_allreduce_per_rank_and_the_same_activations():
    """Two workers, Adam: each ``allreduce`` worker holds the whole model's state, each ``fsdp``
    worker half (every layer's rows cut in two); activations are the per-worker batch's either way."""
    results = {s: run(s) for s in ("allreduce", "fsdp")}
    whole, half = results["allreduce"].final, results["fsdp"].final
    assert results["fsdp"].memory == half["memory_ranks"]
    assert len(whole["memory_ranks"]) == len(half["memory_ranks"]) == 2
    for rank in range(2):
        a, f = whole["memory_ranks"][rank], half["memory_ranks"][rank]
        assert (a["params"], a["grads"]) == (S64, S64)
        assert (f["params"], f["grads"]) == (S64 / 2, S64 / 2)
        steps = 4 * 8  # Adam's step count per parameter: a float64 scalar here (torch's default dtype then)
        assert a["optimizer"] in (2 * S64 + 4 * 4, 2 * S64 + steps)
        assert f["optimizer"] - 2 * S64 / 2 == a["optimizer"] - 2 * S64  # the same step counts, half the moments
        assert f["activations"] == a["activations"] > 48 * 64 * 8  # at least the batch's inputs
        assert f["peak"] > 0 and a["peak"] > 0
    assert "mem/rank state" in epoch_line(half, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_from_the_allocator():
    device = torch.device("cuda")
    model = nn.Linear(256, 256, device=device)
    meter = MemoryMeter(device)
    with meter.watch(model):
        model(torch.randn(64, 256, device=device)).sum().backward()
    figures = meter.figures(model, None)
    assert figures["cuda_peak"] >= torch.cuda.memory_allocated(device) > 0
    assert meter.activations == 64 * 256 * 4  # the input, for the weight's gradient
