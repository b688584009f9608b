"""`partrain bench async`'s time to the target accuracy, on hand-made histories."""

from __future__ import annotations

import math

from partrain.bench.async_ import seconds_to_accuracy


def history(*epochs):
    return [{"seconds": s, "test_accuracy": a} for s, a in epochs]


def test_time_to_accuracy_is_linear_between_the_epoch_ends_around_the_crossing():
    # 0.80 after 2 s, 0.90 after 2 + 3 s: 0.85 is half way through the second epoch
    assert math.isclose(seconds_to_accuracy(history((2.0, 0.80), (3.0, 0.90)), 0.85), 2.0 + 1.5)
    # reached at the third epoch's end exactly
    assert math.isclose(seconds_to_accuracy(history((1.0, 0.5), (1.0, 0.7), (1.0, 0.85), (1.0, 0.9)), 0.85), 3.0)
    # the first evaluation is already over the target: nothing before it is measured, its end counts
    assert seconds_to_accuracy(history((1.5, 0.9), (1.0, 0.95)), 0.85) == 1.5
    # a dip below the previous epoch's accuracy is not interpolated across: first crossing only
    assert math.isclose(seconds_to_accuracy(history((1.0, 0.84), (1.0, 0.80), (2.0, 0.88)), 0.85), 2.0 + 2.0 * 0.05 / 0.08)
    assert math.isnan(seconds_to_accuracy(history((1.0, 0.5), (1.0, 0.6)), 0.85))
