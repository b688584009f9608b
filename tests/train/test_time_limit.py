"""``max_seconds``: training stops at the end of the epoch nearest the time limit, every worker
after the same epoch (the workers' mean seconds, summed with the epoch's figures)."""

from __future__ import annotations

import math

import pytest

from partrain.errors import UsageError
from partrain.train.fit import fit
from partrain.train.stopping import time_is_up
from tests.helpers import assert_states_close, sgd
from tests.train.test_tasks import COMMON, no_launch, regression64, regressor64


@pytest.mark.parametrize("trained,last,limit,up", [
    (4.0, 1.0, 4.5, True),     # this end 0.5 short, the next 0.5 over: a tie stops (the nearer or as near)
    (3.9, 1.0, 4.5, False),    # this end 0.6 short, the next 0.4 over: one more epoch
    (5.0, 1.0, 4.5, True),     # already over
    (1.0, 1.0, 10.0, False),
    (0.0, 0.0, 1e-9, False),   # no time has passed: nothing is up yet
    (1e-6, 1e-6, 1e-9, True),
    (100.0, 100.0, None, False),  # no limit
])
def test_an_epoch_ends_the_run_when_its_end_is_nearer_the_limit_than_the_next(trained, last, limit, up):
    assert time_is_up(trained, last, limit) is up


@pytest.mark.parametrize("strategy", ["allreduce", "hogwild"])
def test_a_limit_shorter_than_an_epoch_stops_every_worker_after_the_first(strategy):
    """Any epoch takes longer than 1 ns: each of 2 workers stops after epoch 1 of 3 (none waits
    in a collective for the other), and under allreduce the model is that of a 1-epoch run."""
    run = dict(COMMON, strategy=strategy, return_state=True, checkpoint=False)
    limited = fit(regressor64, regression64, sgd, epochs=3, max_seconds=1e-9, **run)
    assert limited.stopped == "max_seconds"
    assert [row["epoch"] for row in limited.history] == [1]
    if strategy == "allreduce":  # float64, one thread per worker: the same steps, bit for bit
        one = fit(regressor64, regression64, sgd, epochs=1, **run)
        assert_states_close(limited.model_state, one.model_state, atol=0)


def test_a_limit_longer_than_the_run_changes_nothing():
    run = dict(COMMON, return_state=True, checkpoint=False)
    limited = fit(regressor64, regression64, sgd, epochs=2, max_seconds=1e9, **run)
    plain = fit(regressor64, regression64, sgd, epochs=2, **run)
    assert limited.stopped is None and [r["epoch"] for r in limited.history] == [1, 2]
    assert_states_close(limited.model_state, plain.model_state, atol=0)


@pytest.mark.parametrize("value", [0, -1.0, math.inf, math.nan, True, "10"])
def test_a_bad_limit_is_one_line_before_any_process_starts(value, monkeypatch):
    monkeypatch.setattr("partrain.train.fit.launch", no_launch)
    with pytest.raises(UsageError, match=r"^Expected max_seconds to be a positive number of seconds or None\. "
                                         r"Received: "):
        fit(regressor64, regression64, sgd, epochs=2, max_seconds=value, **COMMON)
