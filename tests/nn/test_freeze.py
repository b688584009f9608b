"""Frozen parameter slices stay bit-exact under every optimizer; the rest trains as without freezing.

Where to start reading: `test_frozen_elements_bit_exact_others_as_without_freezing`.
Its loss gives every element a gradient that depends on that element only, so a
run without freezing is an exact reference for the elements that are not frozen
(per-element optimizers: SGD, Adam, AdamW). The frozen ones must come out
bit-for-bit unchanged although weight decay and Adam move zero-gradient elements.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import partrain
from partrain.errors import UsageError
from partrain.nn import (
    freeze,
    freeze_state_dict,
    frozen_mask,
    idx,
    load_freeze_state_dict,
    unfreeze,
)
from partrain.train.checkpoint import load_checkpoint, save_checkpoint

OPTIMIZERS = {
    "sgd_momentum_wd": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.1),
    "sgd_nesterov_foreach": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True,
                                              weight_decay=0.1, foreach=True),
    "adam_l2": functools.partial(torch.optim.Adam, lr=0.01, weight_decay=0.1),
    "adamw": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.5),
    "adamw_amsgrad_loop": functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.5, amsgrad=True,
                                            foreach=False),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=0.01, momentum=0.5, weight_decay=0.1),
}


def conv():
    torch.manual_seed(0)
    return nn.Conv2d(3, 4, 5)


def elementwise_loss(param, target):
    # d loss / d param[i] depends on param[i] only: freezing one element leaves the others' math alone
    return ((param - target) ** 2 * torch.linspace(0.5, 2.0, param.numel()).view_as(param)).sum()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_frozen_elements_bit_exact_others_as_without_freezing(name):
    steps = 30
    ref, frozen = conv(), conv()
    target = torch.randn_like(ref.weight)
    mask = torch.zeros_like(ref.weight, dtype=torch.bool)
    mask[:, :, 2, 1] = True
    mask[1] = True
    start = frozen.weight.detach().clone()
    freeze(frozen.weight, mask)
    for model in (ref, frozen):
        opt = OPTIMIZERS[name](model.parameters())
        for _ in range(steps):
            opt.zero_grad()
            (elementwise_loss(model.weight, target) + model.bias.square().sum()).backward()
            opt.step()
    w = frozen.weight.detach()
    assert torch.equal(w[mask], start[mask])  # bit-exact
    assert torch.equal(w[~mask], ref.weight.detach()[~mask])  # bit-exact too: same math
    assert not torch.equal(w[~mask], start[~mask])
    assert torch.equal(frozen.bias, ref.bias)
    unfreeze(frozen.weight)


@pytest.mark.parametrize("name", ["sgd_momentum_wd", "adamw"])
def test_real_model_trains_around_a_frozen_kernel(name):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))
    weight = model[0].weight
    start = weight.detach().clone()
    full = freeze(weight, idx[:, :, 1, 2])
    assert full.sum().item() == 4 and torch.equal(frozen_mask(weight), full)
    opt = OPTIMIZERS[name](model.parameters())
    for step in range(20):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert torch.all(weight.grad[:, :, 1, 2] == 0)  # the gradient hook zeroes frozen gradients
        opt.step()
        if step == 0:
            first = {k: v[:, :, 1, 2].clone() for k, v in opt.state[weight].items() if v.shape == weight.shape}
    assert torch.equal(weight[:, :, 1, 2], start[:, :, 1, 2])
    assert not torch.equal(weight[:, :, 0, 0], start[:, :, 0, 0])
    # per-element optimizer state of frozen elements is held still from its creation on
    # (AdamW's moments stay 0; SGD's momentum keeps the weight decay of the first step)
    held = {k: v[:, :, 1, 2] for k, v in opt.state[weight].items() if v.shape == weight.shape}
    assert held.keys() == first.keys() and held
    assert all(torch.equal(held[k], first[k]) for k in held)
    if name == "adamw":
        assert all(torch.all(v == 0) for v in held.values())
    unfreeze(weight)
    opt.step()
    assert not torch.equal(weight[:, :, 1, 2], start[:, :, 1, 2])


def test_index_forms_and_partial_unfreeze():
    w = nn.Parameter(torch.randn(4, 3, 5, 5))
    assert torch.equal(freeze(w, idx[:, :, 2, 1]), freeze(w, (slice(None), slice(None), 2, 1)))
    mask = torch.zeros(4, 3, 5, 5, dtype=torch.bool)
    mask[0, 0] = True
    both = freeze(w, mask)  # adds to the frozen set
    assert both.sum().item() == 12 + 25 - 1
    unfreeze(w, idx[0])
    assert frozen_mask(w).sum().item() == 9 and not frozen_mask(w)[0].any()
    unfreeze(w, idx[1:])
    assert frozen_mask(w) is None  # nothing left frozen: the hooks are gone
    unfreeze(w)  # unfreezing what is not frozen is fine
    freeze(w, idx[torch.tensor([0, 3])])
    assert frozen_mask(w)[[0, 3]].all() and not frozen_mask(w)[1:3].any()
    unfreeze(w)


def test_bad_input_is_one_clear_error():
    w = nn.Parameter(torch.randn(4, 3))
    with pytest.raises(UsageError, match=r"boolean mask of shape \(4, 3\)"):
        freeze(w, torch.zeros(3, 4, dtype=torch.bool))
    with pytest.raises(UsageError, match="index"):
        freeze(w, idx[7])
    with pytest.raises(UsageError, match="leaf"):
        freeze(w * 2, idx[0])
    with pytest.raises(UsageError, match="parameter tensor"):
        freeze([1, 2], idx[0])
    with pytest.raises(UsageError, match="unknown names"):
        load_freeze_state_dict(nn.Linear(2, 2), {"nope": torch.zeros(2, 2, dtype=torch.bool)})


def train(model, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """10 + 10 steps through a checkpoint = 20 steps straight, frozen elements included."""
    def model_fn(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    make_opt = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.3)

    straight = model_fn(0)
    freeze(straight[1].weight, idx[:5])
    freeze(straight[3].bias, idx[2])
    opt = make_opt(straight.parameters())
    train(straight, opt, x, y, 20)

    first = model_fn(0)
    freeze(first[1].weight, idx[:5])
    freeze(first[3].bias, idx[2])
    opt = make_opt(first.parameters())
    train(first, opt, x, y, 10)
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"model": first.state_dict(), "optimizer": opt.state_dict(),
                           "freeze": freeze_state_dict(first)})

    state = load_checkpoint(path)  # weights_only=True: the masks are plain tensors
    resumed = model_fn(123)  # different initial values: everything comes from the checkpoint
    resumed.load_state_dict(state["model"])
    load_freeze_state_dict(resumed, state["freeze"])
    assert set(freeze_state_dict(resumed)) == {"1.weight", "3.bias"}
    opt = make_opt(resumed.parameters())
    opt.load_state_dict(state["optimizer"])
    train(resumed, opt, x, y, 10)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(resumed[1].weight[:5], model_fn(0)[1].weight[:5])


def ddp_worker(strategy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
    # a different initial value on rank 1: DDP's broadcast from rank 0 must win, and freezing follows it
    if strategy.rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1.0)
    freeze(model[0].weight, idx[:, :, 1, 1])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.5)
    model, opt = strategy.prepare(model, opt)
    start = strategy.unwrap(model)[0].weight.detach().clone()
    g = torch.Generator().manual_seed(strategy.rank)
    for _ in range(10):
        x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return start, strategy.unwrap(model).state_dict()


def test_ddp_two_ranks_frozen_bit_exact_and_equal_across_ranks():
    (start0, state0), (start1, state1) = partrain.launch(ddp_worker, workers=2, timeout=60)
    assert torch.equal(start0, start1)
    w = state0["0.weight"]
    assert torch.equal(w[:, :, 1, 1], start0[:, :, 1, 1])
    assert not torch.equal(w[:, :, 0, 0], start0[:, :, 0, 0])
    for k in state0:
        assert torch.equal(state0[k], state1[k]), k
