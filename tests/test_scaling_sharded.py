"""The sharded strategies' communication model (`partrain.scaling`: fsdp, tp), against hand computations.

What it guards: the figures docs/scaling.md prints for fsdp and tp. ZeRO-3 moves 1.5x the bytes
of an all-reduce (gather, gather again, reduce-scatter: (n-1)/n * S each), ZeRO-2 as many; the
latency term counts each collective of each unit; tp all-reduces a micro-batch's activations
four times per block, whatever the model's size.
"""

import math

import pytest

from partrain.errors import UsageError
from partrain.scaling import (
    Link,
    allreduce_bytes,
    allreduce_seconds,
    fsdp_bytes,
    fsdp_seconds,
    predict,
    tp_bytes,
    tp_seconds,
)

LINK = Link(bandwidth=1e9, latency_s=1e-5)


def test_fsdp_moves_one_and_a_half_allreduces():
    assert allreduce_bytes(4, 1000.0) == 1500.0  # 2 * 3/4 * 1000
    assert fsdp_bytes(4, 1000.0) == 2250.0  # 3 * 3/4 * 1000
    assert fsdp_bytes(4, 1000.0, reshard_after_forward=False) == allreduce_bytes(4, 1000.0)
    for n in (2, 8, 64, 512):
        assert math.isclose(fsdp_bytes(n, 1e6), 1.5 * allreduce_bytes(n, 1e6))


def test_fsdp_seconds_by_hand():
    # 8 workers, 1e8 bytes, 5 units: 3 * 7/8 * 1e8 / 1e9 s + 3 * 5 * 7 * 1e-5 s
    assert math.isclose(fsdp_seconds(8, 1e8, LINK, units=5), 0.2625 + 0.00105)
    assert math.isclose(fsdp_seconds(8, 1e8, LINK, units=5, reshard_after_forward=False), 0.175 + 0.0007)
    assert fsdp_seconds(1, 1e8, LINK) == 0.0
    assert math.isclose(predict("fsdp", 8, 1e8, 1.0, LINK), 1.0 / (1.0 + 0.2625 + 0.00021))
    with pytest.raises(UsageError, match="Expected at least one sharding unit. Received: 0"):
        fsdp_seconds(8, 1e8, LINK, units=0)


def test_tp_all_reduces_activations_four_times_a_block():
    # 2 processes, 3 blocks, 1 MB of activations: 12 all-reduces of 2 * 1/2 * 1e6 bytes
    assert tp_bytes(2, 1e6, 3) == 12e6
    assert math.isclose(tp_seconds(2, 1e6, 3, LINK), 12 * allreduce_seconds(2, 1e6, LINK))
    assert math.isclose(tp_seconds(2, 1e6, 3, LINK), 12 * (1e-3 + 2e-5))
    with pytest.raises(UsageError, match="Expected at least one layer. Received: 0"):
        tp_seconds(2, 1e6, 0, LINK)
