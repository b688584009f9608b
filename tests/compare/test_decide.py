"""The recommendation rule and the what-if link, on hand-made measurements (no process starts).

Start at `test_comm_bound_picks_the_strategy_that_sends_less`: each scenario of issue 16
(communication-bound, a straggler, compute-bound) as the figures a window would measure,
and the strategy and the one-line reason the rule must give. The simulated link is checked
against the ring formula computed by hand.
"""

from __future__ import annotations

import math

import pytest

from partrain.compare.decide import compare_losses, loss_at, recommend, simulate_link, waiting_share
from partrain.compare.measure import Measurement


def window(label, strategy, rate, data=0.0, compute=1.0, comm=0.0, bytes_per_sample=0.0, workers=2,
           curve=((0.0, 2.3), (1000.0, 1.0)), **options):
    m = Measurement(label, strategy, options, workers, samples_per_s=rate, data_s=data, compute_s=compute,
                    comm_s=comm, bytes_per_sample=bytes_per_sample, bytes_per_step=bytes_per_sample * 32,
                    curve=list(curve))
    simulate_link(m, None)
    return m


def test_comm_bound_picks_the_strategy_that_sends_less():
    allreduce = window("allreduce", "allreduce", 100.0, compute=0.4, comm=0.6, bytes_per_sample=8000.0)
    localsgd = window("localsgd H=8", "localsgd", 220.0, compute=0.4, comm=0.08, bytes_per_sample=1000.0, period=8,
                      curve=((0.0, 2.3), (1000.0, 0.95)))
    rec = recommend([allreduce, localsgd])
    assert rec.pick == "localsgd H=8"
    assert rec.why.startswith("comm is 60% of allreduce's step: localsgd H=8 cuts the bytes per sample 8x")
    assert rec.others["allreduce"].startswith("0.45x the pick's speed: comm and waiting are 60%")


def test_a_straggler_picks_an_asynchronous_strategy():
    # a 3x straggler: allreduce's fast worker waits 2 of every 3 units, the slow one none
    allreduce = window("allreduce", "allreduce", 67.0, compute=1.0, comm=1.0)
    ps_sync = window("ps sync", "ps", 60.0, compute=1.0, comm=1.1, staleness=0)
    hogwild = window("hogwild", "hogwild", 133.0, compute=1.0, comm=0.0, curve=((0.0, 2.3), (1000.0, 1.05)))
    rec = recommend([allreduce, ps_sync, hogwild], straggler=True)
    assert rec.pick == "hogwild"
    assert rec.why.startswith("allreduce waits for the slowest worker at every step (50% of its step)")


def test_compute_bound_keeps_allreduce():
    allreduce = window("allreduce", "allreduce", 100.0, compute=0.97, comm=0.03, bytes_per_sample=100.0)
    localsgd = window("localsgd H=8", "localsgd", 110.0, compute=0.99, comm=0.004, bytes_per_sample=12.5, period=8)
    single = window("single", "single", 55.0, workers=1)
    rec = recommend([single, allreduce, localsgd])
    assert rec.pick == "allreduce"
    assert rec.why.startswith("communication and waiting are only 3% of its step")
    assert rec.others["single"].startswith("0.55x the pick's speed: one process")


def test_a_fast_strategy_that_does_not_learn_loses_on_time_to_the_target_loss():
    # with loss curves the rule ranks by the time to the target loss (the upper median of the
    # lowest losses: 1.3): allreduce gets there in 7 s (2.0 -> 1.0 over 10 s), hogwild in 10 s
    allreduce = window("allreduce", "allreduce", 100.0, compute=0.5, comm=0.5, curve=((0.0, 2.0), (1000.0, 1.0)))
    allreduce.curve_s = [0.0, 10.0]
    hogwild = window("hogwild", "hogwild", 300.0, curve=((0.0, 2.0), (3000.0, 1.3)))
    hogwild.curve_s = [0.0, 10.0]
    rec = recommend([allreduce, hogwild])
    assert allreduce.time_to_loss == pytest.approx(7.0) and hogwild.time_to_loss == pytest.approx(10.0)
    assert hogwild.loss_ratio == pytest.approx((2.0 - 0.7 / 3) / 1.0)  # at 1000 samples
    assert rec.pick == "allreduce"
    assert rec.others["hogwild"] == ("0.70x the pick's speed: its loss at equal samples is 77% above allreduce's "
                                     "(stale or local updates cost convergence)")


def test_single_wins_when_parallelism_does_not_pay():
    single = window("single", "single", 500.0, workers=1)
    allreduce = window("allreduce", "allreduce", 200.0, compute=0.3, comm=0.7)
    rec = recommend([single, allreduce])
    assert rec.pick == "single" and "parallelism does not pay" in rec.why


def test_a_parallel_strategy_within_the_noise_of_one_process_gives_way_to_it():
    # hogwild 3% faster than one process: inside the 5% floor, so one process (tied with hogwild)
    single = window("single", "single", 1000.0, workers=1)
    hogwild = window("hogwild", "hogwild", 1030.0, compute=1.0, comm=0.0)
    rec = recommend([single, hogwild])
    assert rec.pick == "single" and rec.tied == ["hogwild"]
    assert rec.why == ("tied with hogwild (1.03x its speed, within the windows' noise of 5%); one process does "
                       "as well with fewer processes: parallelism does not pay measurably here")
    # 8% faster: outside the floor, so hogwild
    assert recommend([single, window("hogwild", "hogwild", 1080.0)]).pick == "hogwild"


def test_skipped_and_failed_windows_say_why_and_nothing_measured_is_no_advice():
    skipped = Measurement("pipeline", "pipeline", {}, 2, status="skipped", reason="the model has 1 top-level child")
    allreduce = window("allreduce", "allreduce", 100.0)
    rec = recommend([allreduce, skipped])
    assert rec.others["pipeline"] == "skipped: the model has 1 top-level child"
    assert recommend([skipped]) is None


def test_simulated_link_is_the_ring_formula_on_measured_bytes():
    # 2 workers, 1e6 bytes per step each, 1e7 bytes/s, 1e-3 s latency: 2(n-1)/n S/B + 2(n-1) a = 0.1 + 0.002
    m = Measurement("allreduce", "allreduce", {}, 2, samples_per_s=64.0, data_s=0.1, compute_s=0.4, comm_s=0.01,
                    bytes_per_step=1e6)
    simulate_link(m, 1e7, latency_s=1e-3)
    assert m.simulated_comm_s == pytest.approx(0.102)
    assert m.effective_samples_per_s == pytest.approx(64.0 * 0.51 / (0.5 + 0.102))
    assert waiting_share(m) == pytest.approx(0.102 / 0.602)
    # local SGD with period 4: a quarter of the latency per step, bytes already per step
    local = Measurement("localsgd", "localsgd", {"period": 4}, 2, samples_per_s=64.0, data_s=0.0, compute_s=0.5,
                        comm_s=0.0, bytes_per_step=2.5e5)
    simulate_link(local, 1e7, latency_s=1e-3)
    assert local.simulated_comm_s == pytest.approx(0.025 + 0.0005)
    # one worker, or no what-if: the measured rate stands
    single = Measurement("single", "single", {}, 1, samples_per_s=50.0, data_s=0.0, compute_s=0.5, comm_s=0.0)
    simulate_link(single, 1e7)
    assert single.effective_samples_per_s == 50.0 and single.simulated_comm_s == 0.0


def test_loss_at_equal_samples_interpolates_the_curves():
    curve = [(0.0, 2.0), (100.0, 1.0), (300.0, 0.5)]
    assert loss_at(curve, 50.0) == 1.5 and loss_at(curve, 200.0) == 0.75
    assert math.isnan(loss_at(curve, 301.0))
    ref = window("allreduce", "allreduce", 1.0, curve=[(0.0, 2.0), (200.0, 1.0)])
    other = window("localsgd H=8", "localsgd", 1.0, curve=[(0.0, 2.0), (100.0, 1.2), (400.0, 0.4)])
    assert compare_losses([ref, other]) is ref
    # at 200 samples (the shorter curve's end): 1.2 - 0.8 * 100/300 over 1.0
    assert other.loss_ratio == pytest.approx(1.2 - 0.8 / 3)


def test_allreduce_no_faster_than_one_process_gives_way_to_a_faster_strategy():
    # the figures of a loaded 2-core machine: two allreduce workers no faster than one process
    single = window("single", "single", 1243.0, workers=1)
    allreduce = window("allreduce", "allreduce", 1240.0, compute=0.84, comm=0.16)
    ps_async = window("ps async", "ps", 1430.0, compute=0.88, comm=0.12, staleness=math.inf)
    rec = recommend([single, allreduce, ps_async])
    assert rec.pick == "ps async"
    assert rec.others["single"].startswith("0.87x the pick's speed")


def test_top_two_within_the_windows_noise_are_a_tie():
    from partrain.compare.decide import window_noise

    # epochs of 1.0, 1.6, 1.0, 0.4 s after a first of 2 s: median 1.0, deviations 0, 0.6, 0, 0.6
    # (median 0.3): 1.4826 * 0.3 / 1.0 / sqrt(4) = 0.2224
    noisy = [0.0, 2.0, 3.0, 4.6, 5.6, 6.0]
    assert math.isclose(window_noise(Measurement("x", "hogwild", {}, 2, curve_s=noisy)), 1.4826 * 0.3 / 2)
    assert window_noise(Measurement("x", "hogwild", {}, 2, curve_s=[0.0, 2.0, 3.0])) == 0.0  # one epoch left
    hog = window("hogwild", "hogwild", 230.0, compute=0.4, comm=0.0)
    local = window("localsgd H=8", "localsgd", 220.0, compute=0.4, comm=0.08, bytes_per_sample=1000.0, period=8)
    allreduce = window("allreduce", "allreduce", 100.0, compute=0.4, comm=0.6, bytes_per_sample=8000.0)
    # no epoch times: the 5% floor; 220 / 230 = 0.957 is within it: tied, and of the two the safer,
    # local SGD, is recommended (hogwild's workers overwrite each other's updates)
    rec = recommend([allreduce, hog, local])
    assert rec.pick == "localsgd H=8" and rec.tied == ["hogwild"] and rec.noise == 0.05
    assert rec.why == ("tied with hogwild (1.05x its speed, within the windows' noise of 5%); of the two, "
                       "localsgd H=8 is the safer choice: it averages its workers' models every few steps, where "
                       "hogwild lets its workers' updates overwrite each other")
    assert rec.others["hogwild"].startswith("1.05x the pick's speed: as fast")
    # 200 / 230 = 0.87: outside 5%, but inside a window's 22% noise
    local = window("localsgd H=8", "localsgd", 200.0, compute=0.4, comm=0.08, bytes_per_sample=1000.0, period=8)
    rec = recommend([allreduce, hog, local])
    assert rec.pick == "hogwild" and rec.tied == []
    local.curve_s = noisy
    assert recommend([allreduce, hog, local]).tied == ["hogwild"]
    # a tie whose faster side is already the safer keeps the rule's pick and reason
    ps_async = window("ps async", "ps", 220.0, compute=0.4, comm=0.1, staleness=math.inf)
    rec = recommend([allreduce, window("localsgd H=8", "localsgd", 230.0, compute=0.4, comm=0.08,
                                       bytes_per_sample=1000.0, period=8), ps_async])
    assert rec.pick == "localsgd H=8" and rec.tied == ["ps async"]
    assert rec.why.startswith("tied with ps async (0.96x its speed, within the windows' noise of 5%); comm is 60%")


def test_bench_times_to_target_are_medians_over_runs_by_hand():
    from types import SimpleNamespace

    from partrain.bench.compare import times_to_target

    def run(losses, seconds):
        return SimpleNamespace(curve=[(i * 100.0, v) for i, v in enumerate(losses)], curve_s=seconds)

    runs = {
        # lowest losses 1.0, 0.9, 1.2: median 1.0
        "a": [run([2.0, 1.0], [0, 1.0]), run([2.0, 0.9], [0, 2.0]), run([2.0, 1.2], [0, 1.0])],
        # lowest 0.8, 0.7, 0.6: median 0.7
        "b": [run([2.0, 1.5, 0.8], [0, 1.0, 2.0]), run([2.0, 0.7], [0, 4.0]), run([2.0, 0.6], [0, 1.0])],
        # lowest 1.5 each: median 1.5
        "c": [run([2.0, 1.5], [0, 1.0])] * 3,
    }
    target, times, each = times_to_target(runs)
    assert target == 1.0  # the median of 0.7, 1.0, 1.5
    # a: reaches 1.0 at 1.0 s; at 2 * (2 - 1) / (2 - 0.9) = 1.818 s; never (inf): median 1.818
    assert math.isclose(times["a"], 2 * 1.0 / 1.1)
    # b: 1.0 + (1.5 - 1.0) / (1.5 - 0.8) = 1.714; 4 * 1.0 / 1.3 = 3.077; 1.0 / 1.4 = 0.714: median 1.714
    assert math.isclose(times["b"], 1.0 + 0.5 / 0.7)
    assert math.isnan(times["c"])  # never reached
    # every run's own time, in run order (NaN: never reached)
    assert each["a"][0] == 1.0 and math.isclose(each["a"][1], 2 * 1.0 / 1.1) and math.isnan(each["a"][2])
    assert all(math.isnan(t) for t in each["c"])


def test_a_reference_that_never_reached_the_target_is_said_so():
    from partrain.compare.decide import _why_faster

    hog = window("hogwild", "hogwild", 230.0)
    allreduce = window("allreduce", "allreduce", 100.0, compute=0.5, comm=0.5)
    hog.speed, allreduce.speed = 2.0, 0.0
    assert _why_faster(hog, allreduce, straggler=True) == (
        "allreduce waits for the slowest worker at every step (50% of its step): hogwild does not, and allreduce "
        "never reached the target loss in its window")
    allreduce.speed = 1.0
    assert _why_faster(hog, allreduce, straggler=True).endswith("hogwild does not, 2.00x the speed to the target loss")


def test_a_strategy_that_learns_far_worse_per_sample_is_not_recommended_however_fast():
    # hogwild reaches the windows' shallow target first (3x allreduce's samples/s) but its loss at
    # equal samples is ~3x allreduce's: it would level off higher, so the rule leaves it out of the
    # ranking; local SGD learns as well per sample (4% above) and is next fastest
    allreduce = window("allreduce", "allreduce", 100.0, compute=0.5, comm=0.5, bytes_per_sample=8000.0,
                       curve=((0.0, 2.0), (1000.0, 0.5)))
    allreduce.curve_s = [0.0, 10.0]
    localsgd = window("localsgd H=8", "localsgd", 180.0, compute=0.5, comm=0.06, bytes_per_sample=1000.0,
                      period=8, curve=((0.0, 2.0), (1000.0, 0.52), (1800.0, 0.45)))
    localsgd.curve_s = [0.0, 5.56, 10.0]
    hogwild = window("hogwild", "hogwild", 300.0, curve=((0.0, 2.0), (3000.0, 0.40)))
    hogwild.curve_s = [0.0, 10.0]
    rec = recommend([allreduce, localsgd, hogwild])
    # at 1000 samples: hogwild 2.0 - 1.6 / 3 against allreduce's 0.5; local SGD 0.52
    assert hogwild.loss_ratio == pytest.approx((2.0 - 1.6 / 3) / 0.5)
    assert localsgd.loss_ratio == pytest.approx(1.04)
    # the target is 0.45 (the median of 0.40, 0.45, 0.5): hogwild at 9.69 s, local SGD at 10 s
    assert hogwild.time_to_loss == pytest.approx(1.55 / 1.6 * 10) and localsgd.time_to_loss == pytest.approx(10)
    assert rec.pick == "localsgd H=8" and not rec.tied
    assert rec.others["hogwild"] == ("1.03x the pick's speed: its loss at equal samples is 193% above allreduce's: "
                                     "it reached the windows' target first, but is likely to level off above "
                                     "where the others go on")


def test_when_every_parallel_strategy_learns_far_worse_the_fastest_still_counts():
    hogwild = window("hogwild", "hogwild", 300.0, curve=((0.0, 2.0), (3000.0, 0.2)))
    single = window("single", "single", 100.0, workers=1, curve=((0.0, 2.0), (1000.0, 0.5)))
    for m in (hogwild, single):
        m.curve_s = [0.0, 10.0]
    rec = recommend([single, hogwild])
    assert hogwild.loss_ratio > 2  # against single, the reference without allreduce
    # hogwild reaches 0.5 (the target) at 8.3 s, single at 10 s: no parallel strategy would be left to
    # rank, so the filter steps aside and the fastest counts
    assert rec.pick == "hogwild"
