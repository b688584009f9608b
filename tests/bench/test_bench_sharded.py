"""`partrain bench sharded` (issue 51, Measure): its width search finds what it says.

The full run takes minutes and is run by hand; its toy run, end to end, is `tests/bench/test_smoke.py`'s
(with the checks particular to it: all five goals measured, fsdp's state half of allreduce's). The
search (`largest_width`) is checked here against a hand-made limit, without any process.
"""

from __future__ import annotations

import pytest

from partrain.bench.sharded import Shape, largest_width


@pytest.mark.parametrize("limit", [31, 32, 100, 128, 500, 1000])
def test_the_search_finds_the_largest_multiple_that_fits(limit):
    widths, trials = [], []

    def fits(width):
        widths.append(width)
        return width <= limit

    found, trials = largest_width(fits, first=32, resolution=32, max_trials=20)
    assert found == (limit // 32) * 32
    assert [w for w, _ in trials] == widths and len(set(widths)) == len(widths)  # no width tried twice
    assert widths[:2] == [32, 64][:len(widths[:2])]  # doubling first


def test_the_search_stops_at_its_trial_budget():
    found, trials = largest_width(lambda w: True, first=32, resolution=32, max_trials=3)
    assert found == 128 and [w for w, _ in trials] == [32, 64, 128]


def test_parameter_count_needs_no_memory():
    shape = Shape(width=64, layers=2, heads=2, seq=16, batch=4)
    model = shape.model()
    assert shape.parameters() == sum(p.numel() for p in model.parameters())
