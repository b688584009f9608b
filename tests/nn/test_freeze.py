"""Frozen parameter slices stay bit-exact under every optimizer and every strategy; the rest trains.

Where to start reading: `test_frozen_elements_bit_exact_others_as_without_freezing`.
Its loss gives every element a gradient that depends on that element only, so a
run without freezing is an exact reference for the elements that are not frozen
(per-element optimizers: SGD, Adam, AdamW). The frozen ones must come out
bit-for-bit unchanged although weight decay and Adam move zero-gradient elements.

Freezing belongs to the objects it was applied to: the mask to the parameter
(it survives pickling, ``load_state_dict`` and checkpoints), the step hooks to
the optimizer `keep_frozen` was attached to (an optimizer without them is not
affected). `test_fit_keeps_the_frozen_slice_exact` runs `partrain.fit` under
each strategy as a new user would - the slice frozen in the model factory, SGD
with momentum and weight decay - and compares the slice with its initial values
(``torch.equal``) while the rest of the same tensor must have moved; under
``ps`` the values come from the servers, which run the optimizer.
"""

import functools
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import partrain
from partrain.checkpoint import load_checkpoint, save_checkpoint
from partrain.errors import UsageError
from partrain.models import cnn
from partrain.nn import (
    freeze,
    freeze_state_dict,
    frozen_mask,
    hold_frozen,
    idx,
    keep_frozen,
    load_freeze_state_dict,
    unfreeze,
)
from partrain.strategies import get_strategy

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
        if model is frozen:
            keep_frozen(opt)
        for _ in range(steps):
            opt.zero_grad()
            (elementwise_loss(model.weight, target) + model.bias.square().sum()).backward()
            opt.step()
    w = frozen.weight.detach()
    assert torch.equal(w[mask], start[mask])  # bit-exact
    assert torch.equal(w[~mask], ref.weight.detach()[~mask])  # bit-exact too: same math
    assert not torch.equal(w[~mask], start[~mask])
    assert torch.equal(frozen.bias, ref.bias)


def small_net(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


def batch(seed=0, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def train(model, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("name", ["sgd_momentum_wd", "adamw"])
def test_real_model_trains_around_a_frozen_kernel(name):
    model = small_net()
    x, y = batch()
    weight = model[0].weight
    start = weight.detach().clone()
    full = freeze(weight, idx[:, :, 1, 2])
    assert full.sum().item() == 4 and torch.equal(frozen_mask(weight), full)
    opt = OPTIMIZERS[name](model.parameters())
    keep_frozen(opt)
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


def test_freezing_belongs_to_the_optimizer_it_was_attached_to():
    """No process-wide hooks: an optimizer without `keep_frozen` moves frozen elements (weight decay)."""
    model = small_net()
    x, y = batch()
    weight = model[0].weight
    start = weight.detach().clone()
    freeze(weight, idx[0])
    bare = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    train(model, bare, x, y, 1)
    assert not torch.equal(weight[0], start[0])  # the gradient is zero, weight decay moved it anyway

    held = weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    guard = keep_frozen(opt)
    assert keep_frozen(opt) is guard  # attaching twice is attaching once
    train(model, opt, x, y, 3)
    assert torch.equal(weight[0], held[0]) and not torch.equal(weight[1], held[1])
    guard.remove()
    train(model, opt, x, y, 1)
    assert not torch.equal(weight[0], held[0])


def test_the_mask_travels_with_the_parameter():
    """Pickling (what spawning a worker does), ``load_state_dict`` and ``.to()`` keep the mask."""
    model = small_net()
    freeze(model[0].weight, idx[:, :, 1, 1])
    start = model[0].weight.detach().clone()

    copied = pickle.loads(pickle.dumps(model))
    assert torch.equal(frozen_mask(copied[0].weight), frozen_mask(model[0].weight))
    copied.load_state_dict(small_net(seed=5).state_dict())
    copied.double().float()
    assert torch.equal(frozen_mask(copied[0].weight), frozen_mask(model[0].weight))

    # torch never pickles hooks: keep_frozen gives the copy its gradient hook back
    opt = torch.optim.AdamW(copied.parameters(), lr=0.01, weight_decay=0.5)
    keep_frozen(opt)
    x, y = batch()
    F.cross_entropy(copied(x), y).backward()
    assert torch.all(copied[0].weight.grad[:, :, 1, 1] == 0)
    copied_start = copied[0].weight.detach().clone()
    opt.step()
    train(copied, opt, x, y, 5)
    assert torch.equal(copied[0].weight[:, :, 1, 1], copied_start[:, :, 1, 1])
    assert not torch.equal(copied[0].weight[:, :, 0, 0], copied_start[:, :, 0, 0])
    # the original is untouched by what happened to the copy
    assert torch.equal(model[0].weight, start)


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
    assert frozen_mask(w) is None  # nothing left frozen
    unfreeze(w)  # unfreezing what is not frozen is fine
    freeze(w, idx[torch.tensor([0, 3])])
    assert frozen_mask(w)[[0, 3]].all() and not frozen_mask(w)[1:3].any()


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
    with pytest.raises(UsageError, match=r"boolean mask of shape \(2, 2\) for 'weight'"):
        load_freeze_state_dict(nn.Linear(2, 2), {"weight": torch.zeros(2, 3, dtype=torch.bool)})
    with pytest.raises(UsageError, match="torch.optim.Optimizer"):
        keep_frozen([w])


def test_checkpoint_resume_is_bit_exact(tmp_path):
    """10 + 10 steps through a checkpoint = 20 steps straight, frozen elements included."""
    def model_fn(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))

    x, y = batch(n=32)
    make_opt = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.3)

    straight = model_fn(0)
    freeze(straight[1].weight, idx[:5])
    freeze(straight[3].bias, idx[2])
    opt = make_opt(straight.parameters())
    keep_frozen(opt)
    train(straight, opt, x, y, 20)

    first = model_fn(0)
    freeze(first[1].weight, idx[:5])
    freeze(first[3].bias, idx[2])
    opt = make_opt(first.parameters())
    keep_frozen(opt)
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
    keep_frozen(opt)
    opt.load_state_dict(state["optimizer"])
    train(resumed, opt, x, y, 10)
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(resumed[1].weight[:5], model_fn(0)[1].weight[:5])


def test_hold_frozen_keeps_elements_through_changes_outside_a_step():
    """What local SGD's averaging and DiLoCo's outer step rely on: the block cannot move frozen elements."""
    p = nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    momentum = torch.randn(3, 4, dtype=torch.float64)
    other = nn.Parameter(torch.randn(2, dtype=torch.float64))  # not frozen: changes freely
    freeze(p, idx[1])
    before, m_before, o_before = p.detach().clone(), momentum.clone(), other.detach().clone()
    with hold_frozen([p, other], [momentum, torch.zeros(2)]), torch.no_grad():
        p.add_(1.0)
        momentum.mul_(2.0)
        other.add_(1.0)
    assert torch.equal(p[1], before[1]) and torch.equal(momentum[1], m_before[1])
    assert torch.equal(p[0], before[0] + 1.0) and torch.equal(momentum[0], 2.0 * m_before[0])
    assert torch.equal(other, o_before + 1.0)


def test_a_pinned_guard_restores_the_pinned_values():
    """``hogwild``'s mode: each step restores the values of the pin, not a snapshot before the step
    (which could catch another process's step half way through the shared memory)."""
    model = small_net()
    x, y = batch()
    weight = model[0].weight
    freeze(weight, idx[2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)
    keep_frozen(opt).pin()
    pinned = weight.detach().clone()
    train(model, opt, x, y, 2)
    with torch.no_grad():
        weight[2].add_(1.0)  # as another worker's step half way through would
    train(model, opt, x, y, 1)
    assert torch.equal(weight[2], pinned[2]) and not torch.equal(weight[3], pinned[3])
    freeze(weight, idx[3])  # frozen after the pin: held from its next step on
    at_freeze = weight.detach().clone()
    train(model, opt, x, y, 2)
    assert torch.equal(weight[2:4], torch.cat([pinned[2:3], at_freeze[3:4]]))


# ----- under partrain.fit, every strategy ----------------------------------------------------------
# Small tensors instead of a dataset to load, a few steps, one launch per strategy (on the module's
# pool of processes, tests/conftest.py; ps also runs its server there).

def frozen_cnn():
    """The new user's model factory: half of the first convolution's filters frozen."""
    model = cnn(width=8)
    freeze(model[0].weight, idx[0:4])
    return model


def plain_cnn():
    return cnn(width=8)


def initial_first_conv():
    torch.manual_seed(0)  # fit seeds every worker with its seed (0) before calling the factory
    return frozen_cnn()[0].weight.detach().clone()


def digits_like(n):
    g = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))


DATA = (digits_like(128), digits_like(16))  # 4 steps per epoch for 2 workers of 16 samples
sgd_momentum_wd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.1)
adamw = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.5)

FIT_CASES = {  # name: (strategy, options, optimizer, workers)
    "allreduce": ("allreduce", {}, sgd_momentum_wd, 2),
    "ps_bounded": ("ps", {"staleness": 2}, adamw, 2),
    "ps_async_two_servers": ("ps", {"staleness": math.inf, "servers": 2}, sgd_momentum_wd, 2),
    "hogwild": ("hogwild", {}, sgd_momentum_wd, 2),
    # three workers: the average of three equal values, (x + x + x) / 3, need not be x
    "localsgd": ("localsgd", {"period": 2}, sgd_momentum_wd, 3),
    "diloco": ("localsgd", {"period": 2, "outer": "nesterov"}, sgd_momentum_wd, 3),
}


def fit_frozen(strategy, optimizer_fn, model_fn=frozen_cnn, **kw):
    kw = {"workers": 2, "epochs": 1, "max_steps": 4, "checkpoint": False, **kw}
    return partrain.fit(model_fn, DATA, optimizer_fn, strategy=strategy, batch_size=16, quiet=True,
                        return_state=True, timeout=60, **kw)


def assert_slice_frozen_rest_moved(weight, start):
    assert torch.equal(weight[0:4], start[0:4])  # bit-exact
    assert not torch.equal(weight[4:], start[4:])  # the same tensor's other filters trained


@pytest.mark.parametrize("case", sorted(FIT_CASES))
def test_fit_keeps_the_frozen_slice_exact(case):
    name, options, optimizer_fn, workers = FIT_CASES[case]
    result = fit_frozen(get_strategy(name, **options), optimizer_fn, workers=workers)
    assert_slice_frozen_rest_moved(result.model_state["0.weight"], initial_first_conv())


def test_fit_ps_sync_keeps_frozen_exact_across_a_resume_from_the_masks_in_the_checkpoint(tmp_path):
    """ps, staleness 0: the servers hold the slice; the resumed run's factory freezes nothing,
    so the masks can only come from the checkpoint (and reach the servers in the hello)."""
    start = initial_first_conv()
    first = fit_frozen(get_strategy("ps", staleness=0), sgd_momentum_wd, epochs=1, max_steps=3,
                       out_dir=str(tmp_path), checkpoint=True)
    assert_slice_frozen_rest_moved(first.model_state["0.weight"], start)
    assert set(load_checkpoint(first.checkpoint)["freeze"]) == {"0.weight"}
    resumed = fit_frozen(get_strategy("ps", staleness=0), sgd_momentum_wd, model_fn=plain_cnn, epochs=2,
                         max_steps=6, out_dir=str(tmp_path), resume="auto", checkpoint=True)
    assert resumed.final["step"] == 6
    assert_slice_frozen_rest_moved(resumed.model_state["0.weight"], start)
    assert not torch.equal(resumed.model_state["0.weight"][4:], first.model_state["0.weight"][4:])
