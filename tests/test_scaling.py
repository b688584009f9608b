"""The communication model of `partrain.scaling`, against hand computations."""

import math

import pytest

from partrain.errors import UsageError
from partrain.scaling import (
    Link,
    allreduce_seconds,
    efficiency,
    local_sgd_seconds,
    pipeline_bubble,
    predict,
    ps_seconds,
)

LINK = Link(bandwidth=1e9, latency_s=1e-5)


def test_each_formula_by_hand():
    assert allreduce_seconds(1, 1e6, LINK) == 0.0
    assert math.isclose(allreduce_seconds(4, 1e6, LINK), 2 * 3 / 4 * 1e-3 + 6 * 1e-5)
    assert math.isclose(allreduce_seconds(8, 1e6, LINK, tree=True), 2 * 7 / 8 * 1e-3 + 2 * 3 * 1e-5)
    assert math.isclose(ps_seconds(16, 1e6, LINK, shards=2), 2 * 16 * 1e6 / 2e9 + 2e-5)
    assert math.isclose(local_sgd_seconds(4, 1e6, LINK, period=8), allreduce_seconds(4, 1e6, LINK) / 8)
    assert pipeline_bubble(4, 12) == 3 / 15 and pipeline_bubble(1, 5) == 0.0
    assert efficiency(3e-3, 1e-3) == 0.75
    assert efficiency(3e-3, 1e-3, overlap=True) == 1.0  # hidden behind the backward (2 ms)
    assert math.isclose(efficiency(3e-3, 4e-3, overlap=True), 3 / 5)  # 2 ms of 4 exposed
    assert math.isclose(Link.gbit(10).bandwidth, 1.25e9)


def test_predict_picks_the_formula_and_default_shards():
    compute = 3e-3
    assert predict("allreduce", 8, 1e6, compute, LINK) == efficiency(compute, allreduce_seconds(8, 1e6, LINK))
    assert predict("ps", 64, 1e6, compute, LINK) == efficiency(compute, ps_seconds(64, 1e6, LINK, shards=8))
    assert predict("localsgd", 8, 1e6, compute, LINK, period=4) == efficiency(
        compute, local_sgd_seconds(8, 1e6, LINK, period=4))
    # more workers never make a ring all-reduce step cheaper; local SGD always costs less per step
    effs = [predict("allreduce", n, 1e6, compute, LINK) for n in (2, 8, 64, 512)]
    assert effs == sorted(effs, reverse=True)
    assert predict("localsgd", 64, 1e6, compute, LINK) > predict("allreduce", 64, 1e6, compute, LINK)


@pytest.mark.parametrize("call,expected", [
    (lambda: predict("hogwild", 8, 1e6, 1e-3, LINK), "Expected a strategy among ['allreduce', 'ps', 'localsgd', 'fsdp']"),
    (lambda: predict("allreduce", 0, 1e6, 1e-3, LINK), "Expected a positive number of workers. Received: 0"),
    (lambda: predict("allreduce", 2, 1e6, 0.0, LINK), "Expected model_bytes >= 0 and compute_s > 0"),
    (lambda: ps_seconds(2, 1e6, LINK, shards=0), "Expected at least one server shard. Received: 0"),
    (lambda: local_sgd_seconds(2, 1e6, LINK, period=0), "Expected a period of at least 1 step. Received: 0"),
    (lambda: pipeline_bubble(0, 4), "Expected stages and micro-batches >= 1"),
])
def test_bad_input_is_one_line(call, expected):
    with pytest.raises(UsageError) as e:
        call()
    assert str(e.value).startswith(expected)


def test_throughput_from_measured_constants_by_hand():
    from partrain.scaling import Constants, samples_per_s, scaling_efficiency, step_seconds

    c = Constants(step_s=0.01, batch=32, model_bytes=1e6)
    # allreduce on 2 workers: 0.01 + 2 * 1/2 * 1e6/1e9 + 2 * 1 * 1e-5 = 0.01102 s per step of 64 samples
    assert math.isclose(step_seconds("allreduce", 2, c, LINK), 0.01102)
    assert math.isclose(samples_per_s("allreduce", 2, c, LINK), 64 / 0.01102)
    assert math.isclose(scaling_efficiency("allreduce", 2, c, LINK), 0.01 / 0.01102)
    # ps at 64 workers: 8 shards, 2 * 64 * 1e6 / (8 * 1e9) + 2e-5 on top of the step
    assert math.isclose(step_seconds("ps", 64, c, LINK), 0.01 + 0.016 + 2e-5)
    # local SGD, period 4: a quarter of the ring
    assert math.isclose(step_seconds("localsgd", 8, c, LINK, period=4),
                        0.01 + (2 * 7 / 8 * 1e-3 + 14 * 1e-5) / 4)
    # a pipeline of 4 stages, 4 micro-batches: a quarter of the step, stretched by (m + p - 1) / m
    assert math.isclose(step_seconds("pipeline", 4, c, LINK, microbatches=4), 0.01 / 4 * 7 / 4)
    assert math.isclose(samples_per_s("pipeline", 4, c, LINK, microbatches=4), 32 / (0.01 / 4 * 7 / 4))
    assert samples_per_s("allreduce", 1, c, LINK) == 3200.0
    with pytest.raises(UsageError, match="Expected a strategy among"):
        step_seconds("hogwild", 2, c, LINK)


def test_the_host_factor_stretches_the_compute_part_of_every_step():
    from partrain.scaling import Constants, samples_per_s, scaling_efficiency, step_seconds

    c = Constants(step_s=0.01, batch=32, model_bytes=1e6, host_factor=1.5)
    # allreduce on 2 workers: 1.5 * 0.01 + 1e-3 + 2e-5 (the link part as without h)
    assert math.isclose(step_seconds("allreduce", 2, c, LINK), 0.01602)
    assert math.isclose(samples_per_s("allreduce", 2, c, LINK), 64 / 0.01602)
    # efficiency is against one worker alone (no h): what the shared host costs shows in it
    assert math.isclose(scaling_efficiency("allreduce", 2, c, LINK), 0.01 / 0.01602)
    assert math.isclose(step_seconds("pipeline", 4, c, LINK, microbatches=4), 0.015 / 4 * 7 / 4)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(UsageError, match="Expected a host factor h > 0"):
            step_seconds("allreduce", 2, Constants(0.01, 32, 1e6, bad), LINK)


def test_bucket_messages_and_contention_by_hand():
    from partrain.scaling import Constants, samples_per_s, scaling_efficiency, step_seconds

    # k = 3 buckets, c = 2 ms, h = 1.2; the same 1 MB gradient
    c = Constants(step_s=0.01, batch=32, model_bytes=1e6, host_factor=1.2, messages=3, contention_s=2e-3)
    # allreduce on 2 workers: 1.2 * 0.01 + 0.002 + 2 * 1/2 * 1e6/1e9 + 2 * 1 * 3 * 1e-5 = 0.01506
    assert math.isclose(step_seconds("allreduce", 2, c, LINK), 0.01506)
    assert math.isclose(samples_per_s("allreduce", 2, c, LINK), 64 / 0.01506)
    assert math.isclose(scaling_efficiency("allreduce", 2, c, LINK), 0.01 / 0.01506)
    # on 8 workers: 0.012 + 0.002 + 2 * 7/8 * 1e-3 + 2 * 7 * 3 * 1e-5 = 0.01617
    assert math.isclose(step_seconds("allreduce", 8, c, LINK), 0.01617)
    # local SGD, period 4: one flat all-reduce (one message) and a quarter of c per step:
    # 0.012 + (2 * 7/8 * 1e-3 + 14 * 1e-5) / 4 + 0.002 / 4 = 0.0129725
    assert math.isclose(step_seconds("localsgd", 8, c, LINK, period=4), 0.0129725)
    # one worker neither communicates nor contends: h t1 alone
    assert math.isclose(step_seconds("allreduce", 1, c, LINK), 0.012)
    # ps and pipeline do not use k or c
    assert math.isclose(step_seconds("ps", 64, c, LINK), 0.012 + 0.016 + 2e-5)
    # the default constants (k = 1, c = 0) are the formula without them
    plain = Constants(step_s=0.01, batch=32, model_bytes=1e6)
    assert math.isclose(step_seconds("allreduce", 2, plain, LINK), 0.01102)
    # DDP's bookkeeping o = 0.5 ms: on every allreduce step of two workers or more, on no other strategy's
    with_o = Constants(step_s=0.01, batch=32, model_bytes=1e6, host_factor=1.2, messages=3, contention_s=2e-3,
                       overhead_s=5e-4)
    assert math.isclose(step_seconds("allreduce", 2, with_o, LINK), 0.01556)
    assert math.isclose(step_seconds("allreduce", 8, with_o, LINK), 0.01667)
    assert math.isclose(step_seconds("allreduce", 1, with_o, LINK), 0.012)  # one worker runs without DDP
    assert math.isclose(step_seconds("localsgd", 8, with_o, LINK, period=4), 0.0129725)
    assert math.isclose(step_seconds("ps", 64, with_o, LINK), 0.012 + 0.016 + 2e-5)
    for bad, match in (({"messages": 0}, "Expected k >= 1 messages"), ({"messages": 1.5}, "Expected k >= 1"),
                       ({"contention_s": -1e-3}, "Expected a contention c >= 0"),
                       ({"contention_s": float("nan")}, "Expected a contention c >= 0"),
                       ({"overhead_s": -1e-4}, "Expected DDP's overhead o >= 0"),
                       ({"overhead_s": float("inf")}, "Expected DDP's overhead o >= 0")):
        with pytest.raises(UsageError, match=match):
            step_seconds("allreduce", 2, Constants(0.01, 32, 1e6, **bad), LINK)
