"""Shared pieces of the test suite: small factories that pickle to worker processes."""

import functools

import torch

from partrain.models import cnn, mlp


def small_cnn():
    return cnn(width=8)


def small_mlp():
    return mlp(in_features=64, hidden=32, depth=1)


def sgd(params, lr=0.05, momentum=0.9, weight_decay=1e-4):
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)


sgd_plain = functools.partial(sgd, momentum=0.0, weight_decay=0.0)


def assert_states_close(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
