"""Quantiles by the nearest-rank rule (`partrain._stats`): the stream's metrics, the benchmarks and
the RL learner's policy lag all report through it. Checked by hand on small lists."""

from __future__ import annotations

import math
from array import array

import pytest

from partrain._stats import percentile, quantiles
from partrain.rl.learner import percentile as percentile_0_100


def test_nearest_rank_by_hand():
    values = [3.0, 1.0, 2.0, 5.0, 4.0]  # sorted: 1 2 3 4 5
    # the ceil(q n)-th smallest: q 0.5 -> 3rd, 0.99 -> 5th, 0.2 -> 1st, 0.21 -> 2nd, 0 -> the first
    assert quantiles(values, (0.5, 0.99, 0.2, 0.21, 0.0, 1.0)) == [3.0, 5.0, 1.0, 2.0, 1.0, 5.0]
    assert quantiles(array("d", values), (0.5,)) == [3.0]  # a flat buffer as it is
    assert percentile([7], 0.99) == 7.0


def test_integers_and_the_rl_learners_scale_of_0_to_100():
    lags = [0, 4, 1, 1, 2, 1, 3]  # sorted: 0 1 1 1 2 3 4
    assert percentile_0_100(lags, 50) == 1.0  # the 4th of 7
    assert percentile_0_100(lags, 99) == 4.0


@pytest.mark.parametrize("values", [[], array("d")])
def test_no_values_give_nan(values):
    assert all(math.isnan(v) for v in quantiles(values, (0.5, 0.99)))
    assert math.isnan(percentile(values, 0.5))
