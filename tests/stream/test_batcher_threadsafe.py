"""The Batcher's faces for online training: submit_threadsafe, run_batch, evict_oldest, overlap_answers.

These generalise `partrain.batching.Batcher` for `OnlineTrainer` (they are
tested here, next to their user; tests/serve covers the serving path). The
reference is the model run on each request alone; every wait is on a condition
(an Event the model waits for, a future's result with a bound).
"""

from __future__ import annotations

import threading

import pytest
import torch

from partrain.batching import Batcher, BatcherClosed, Evicted

from ..waiting import wait_until


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_many_threads_each_get_their_own_rows_in_their_order():
    seen: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        seen.extend(int(v) for v in x[:, 0])
        return x * 2

    batcher = Batcher(fn, max_batch_size=16, policy="none").start_background()
    futures = {}

    def produce(k: int) -> None:
        for i in range(250):
            value = k * 1000 + i
            futures[value] = batcher.submit_threadsafe(torch.tensor([[float(value), 1.0]]))

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for value, future in futures.items():
        assert torch.equal(future.result(30), torch.tensor([[2.0 * value, 2.0]]))
    batcher.stop_background()
    assert len(seen) == 1000 and batcher.stats.answered == 1000
    for k in range(4):  # each producer's requests reached the model in the order it made them
        mine = [v for v in seen if v // 1000 == k]
        assert mine == sorted(mine)


def test_a_request_after_an_idle_spell_is_never_stranded():
    # the loop is woken only while it waits: each request here finds it waiting
    batcher = Batcher(double, max_batch_size=4, policy="none").start_background()
    for i in range(300):
        assert batcher.submit_threadsafe(torch.full((1, 1), float(i))).result(30).item() == 2.0 * i
    batcher.stop_background()


def test_run_batch_gets_payloads_with_autograd_on():
    modes = []

    def run_batch(batch):
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return [p.inputs[0] + p.payload for p in batch]

    batcher = Batcher(None, run_batch=run_batch).start_background()
    got = batcher.submit_threadsafe(torch.ones(1, 2), payload=5.0).result(30)
    batcher.stop_background()
    assert torch.equal(got, torch.full((1, 2), 6.0)) and modes == [(False, True)]
    with pytest.raises(ValueError, match="Expected a model function fn or a run_batch hook"):
        Batcher(None)


def gated_batcher(**options) -> tuple[Batcher, threading.Event, threading.Event]:
    entered, gate = threading.Event(), threading.Event()

    def fn(x):
        entered.set()
        assert gate.wait(30), "the test never opened the gate"
        return x

    return Batcher(fn, policy="none", **options).start_background(), entered, gate


def test_evict_oldest_makes_room_and_says_so():
    batcher, entered, gate = gated_batcher(max_queue=2, max_batch_size=8)
    running = batcher.submit_threadsafe(torch.zeros(1, 1))
    wait_until(entered.is_set, "the first batch to run")
    waiting = [batcher.submit_threadsafe(torch.full((1, 1), float(i)), evict_oldest=True) for i in range(3)]
    refused = batcher.submit_threadsafe(torch.full((1, 1), 9.0))  # no eviction asked: QueueFull
    gate.set()
    with pytest.raises(Evicted):
        waiting[0].result(30)
    assert [f.result(30).item() for f in waiting[1:]] == [1.0, 2.0] and running.result(30).item() == 0.0
    with pytest.raises(Exception, match="queue is full"):
        refused.result(30)
    batcher.stop_background()
    assert batcher.stats.evicted == 1 and batcher.stats.rejected == 2


def test_overlap_answers_after_the_next_batch_starts():
    entered = [threading.Event(), threading.Event()]
    gates = [threading.Event(), threading.Event()]
    calls = []

    def fn(x):
        k = len(calls)
        calls.append(k)
        entered[k].set()
        assert gates[k].wait(30), "the test never opened the gate"
        return x

    batcher = Batcher(fn, policy="none", max_batch_size=4, overlap_answers=True).start_background()
    first = batcher.submit_threadsafe(torch.zeros(1, 1))
    wait_until(entered[0].is_set, "the first batch to run")
    second = batcher.submit_threadsafe(torch.ones(1, 1))
    gates[0].set()
    wait_until(entered[1].is_set, "the second batch to run")
    first.result(30)  # answered while the second batch runs
    assert not second.done() and batcher.in_flight == 1
    gates[1].set()
    assert second.result(30).item() == 1.0  # nothing follows: answered before the loop waits again
    wait_until(lambda: batcher.in_flight == 0, "nothing in flight")
    batcher.stop_background()


def test_stop_drains_what_was_handed_over_before_it():
    batcher, entered, gate = gated_batcher(max_batch_size=64)
    futures = [batcher.submit_threadsafe(torch.full((1, 1), float(i))) for i in range(50)]
    stopper = threading.Thread(target=batcher.stop_background)
    stopper.start()
    gate.set()
    stopper.join(60)
    assert [f.result(0).item() for f in futures] == [float(i) for i in range(50)]
    with pytest.raises(BatcherClosed):
        batcher.submit_threadsafe(torch.zeros(1, 1))
