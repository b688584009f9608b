"""Batcher: every accepted request is answered exactly once, with its own rows.

The reference is the model run on each request alone. Start with
`test_collect_batch_*` (the plain collecting function, no loop), then the asyncio
and thread tests under random arrivals, deadlines and cancellations.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from collections import deque

import pytest
import torch

from partrain.batching import Pending, batch_key
from partrain.serve import (
    AdaptivePolicy,
    Batcher,
    BatcherClosed,
    FixedPolicy,
    QueueFull,
    collect_batch,
    make_policy,
)

from ..waiting import async_wait_until, wait_until

torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).eval()


def alone(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return MODEL(x)


def pending(rows: int, width: int = 6, deadline: float | None = None) -> Pending:
    x = torch.zeros(rows, width)
    return Pending((x,), rows, None, deadline, 0.0, batch_key((x,), False))


# ----------------------------------------------------------------- collect_batch (no loop)


def test_collect_batch_takes_in_order_up_to_max_rows() -> None:
    q = deque([pending(3), pending(2), pending(4), pending(1)])
    batch, expired = collect_batch(q, 6, now=1.0)
    assert [p.rows for p in batch] == [3, 2]
    assert not expired and [p.rows for p in q] == [4, 1]


def test_collect_batch_oversized_request_runs_alone() -> None:
    q = deque([pending(10), pending(1)])
    batch, _ = collect_batch(q, 4, now=1.0)
    assert [p.rows for p in batch] == [10] and len(q) == 1


def test_collect_batch_drops_dead_and_returns_expired() -> None:
    dead = pending(1)
    dead.dead = True
    late = pending(1, deadline=0.5)
    q = deque([dead, late, pending(2), pending(2, deadline=9.0)])
    batch, expired = collect_batch(q, 8, now=1.0)
    assert expired == [late] and [p.rows for p in batch] == [2, 2] and not q


def test_collect_batch_groups_by_shape_and_keeps_order() -> None:
    a1, b1, a2, b2 = pending(1, 6), pending(1, 5), pending(1, 6), pending(1, 5)
    q = deque([a1, b1, a2, b2])
    batch, _ = collect_batch(q, 8, now=1.0)
    assert batch == [a1, a2] and list(q) == [b1, b2]


# ----------------------------------------------------------------- policies


def test_adaptive_policy_lone_request_waits_for_nothing() -> None:
    p = AdaptivePolicy()
    p.observe_arrival(0.0)
    p.observe_arrival(1.0)  # one request per second
    p.observe_batch(1, 0.002)
    assert p.wait_time(queued_requests=1, queued_rows=1, oldest_age=0.0, since_last_arrival=0.0,
                       max_batch_size=64) == 0.0


def test_adaptive_policy_waits_under_a_burst_but_bounded() -> None:
    p = AdaptivePolicy()
    for i in range(20):
        p.observe_arrival(i * 1e-5)  # 10 us apart
    p.observe_batch(1, 0.002)
    p.observe_batch(64, 0.004)
    w = p.wait_time(queued_requests=2, queued_rows=2, oldest_age=0.0, since_last_arrival=0.0, max_batch_size=64)
    assert 0 < w <= 2 * p.gap + 1e-12
    full = p.wait_time(queued_requests=64, queued_rows=64, oldest_age=0.0, since_last_arrival=0.0,
                       max_batch_size=64)
    assert full == 0.0
    old = p.wait_time(queued_requests=2, queued_rows=2, oldest_age=0.01, since_last_arrival=0.0,
                      max_batch_size=64)
    assert old == 0.0  # never longer than L(max_batch_size) after the oldest request


def test_make_policy_parses_and_rejects() -> None:
    assert isinstance(make_policy("adaptive"), AdaptivePolicy)
    assert make_policy("fixed:5").max_wait == pytest.approx(0.005)
    assert make_policy("fixed(2)").max_wait == pytest.approx(0.002)
    assert make_policy("none").max_wait == 0.0
    for bad in ("fixed:-1", "fixed:x", "sometimes"):
        with pytest.raises(ValueError, match="Expected a batching policy"):
            make_policy(bad)


# ----------------------------------------------------------------- asyncio


@pytest.mark.parametrize("policy", ["adaptive", "fixed:2", "none"])
def test_async_random_arrivals_each_caller_gets_its_rows(policy: str) -> None:
    rng = random.Random(1)

    async def main() -> None:
        async with Batcher(MODEL, max_batch_size=16, policy=policy) as b:
            async def one(i: int) -> tuple[torch.Tensor, torch.Tensor]:
                await asyncio.sleep(rng.random() * 0.02)
                x = torch.randn(rng.randint(1, 5), 6)
                return x, await b.submit(x)

            results = await asyncio.gather(*(one(i) for i in range(150)))
            for x, y in results:
                torch.testing.assert_close(y, alone(x), rtol=1e-5, atol=1e-6)
            assert b.stats.answered == 150 and b.stats.rows == sum(x.shape[0] for x, _ in results)
            assert max(b.stats.batch_sizes) <= 16

    asyncio.run(main())


def test_async_busy_model_fills_batches() -> None:
    """While the model runs, requests accumulate: a burst is served in few batches."""

    def slow(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return x * 2

    async def main() -> None:
        async with Batcher(slow, max_batch_size=32) as b:
            xs = [torch.full((1, 2), float(i)) for i in range(64)]
            ys = await asyncio.gather(*(b.submit(x) for x in xs))
            assert all(torch.equal(y, x * 2) for x, y in zip(xs, ys))
            assert b.stats.batches <= 6

    asyncio.run(main())


def test_async_deadlines_and_cancellations_answered_exactly_once() -> None:
    """Expired requests raise TimeoutError and never run; cancelled ones are dropped."""
    seen: list[float] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        seen.extend(x[:, 0].tolist())
        time.sleep(0.005)
        return x + 1

    async def main() -> None:
        rng = random.Random(2)
        async with Batcher(model, max_batch_size=4, policy="fixed:1") as b:
            tasks, kinds = [], []
            for i in range(80):
                kind = rng.choice(["ok", "ok", "expire", "cancel"])
                x = torch.tensor([[float(i), 0.0]])
                deadline = time.monotonic() - 1 if kind == "expire" else time.monotonic() + 30
                tasks.append(asyncio.create_task(b.submit(x, deadline=deadline)))
                kinds.append(kind)
            await asyncio.sleep(0)
            for t, kind in zip(tasks, kinds):
                if kind == "cancel":
                    t.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for i, (kind, out) in enumerate(zip(kinds, outcomes)):
            if kind == "ok":
                assert torch.equal(out, torch.tensor([[i + 1.0, 1.0]]))
            elif kind == "expire":
                assert isinstance(out, TimeoutError)
                assert float(i) not in seen
            else:
                assert isinstance(out, asyncio.CancelledError) or torch.is_tensor(out)
                if isinstance(out, asyncio.CancelledError):
                    assert float(i) not in seen
        assert len(seen) == len(set(seen))  # nothing ran twice

    asyncio.run(main())


def test_exception_reaches_every_caller_of_the_batch_and_batcher_survives() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        if (x < 0).any():
            raise ValueError("negative input")
        return x

    async def main() -> None:
        async with Batcher(model, max_batch_size=8, policy="fixed:20") as b:
            outs = await asyncio.gather(b.submit(torch.ones(1, 1)), b.submit(-torch.ones(1, 1)),
                                        return_exceptions=True)
            assert all(isinstance(o, ValueError) for o in outs)
            assert torch.equal(await b.submit(torch.ones(2, 1)), torch.ones(2, 1))

    asyncio.run(main())


def test_wrong_number_of_output_rows_is_an_error_for_callers() -> None:
    async def main() -> None:
        async with Batcher(lambda x: x[:1], max_batch_size=8) as b:
            with pytest.raises(RuntimeError, match="Expected the model to return 3 rows"):
                await b.submit(torch.ones(3, 2))

    asyncio.run(main())


def test_queue_full_rejects_and_drain_on_stop_loses_nothing() -> None:
    release = threading.Event()

    def model(x: torch.Tensor) -> torch.Tensor:
        release.wait(10)
        return x * 3

    async def main() -> None:
        b = Batcher(model, max_batch_size=2, max_queue=5, policy="none")
        await b.start()
        first = asyncio.create_task(b.submit(torch.ones(1, 1)))
        await async_wait_until(lambda: b.in_flight == 1, "the first batch in flight (blocked)")
        queued = [asyncio.create_task(b.submit(torch.full((1, 1), float(i)))) for i in range(5)]
        await async_wait_until(lambda: b.queue_depth == 5, "five requests queued behind it")
        with pytest.raises(QueueFull):
            await b.submit(torch.ones(1, 1))
        stopping = asyncio.create_task(b.stop(drain=True))
        await async_wait_until(lambda: not b.running, "the batcher to stop accepting")
        with pytest.raises(BatcherClosed):
            await b.submit(torch.ones(1, 1))
        release.set()
        await stopping
        assert torch.equal(await first, torch.full((1, 1), 3.0))
        for i, t in enumerate(queued):
            assert torch.equal(await t, torch.full((1, 1), 3.0 * i))
        assert b.stats.rejected == 1 and b.stats.answered == 6

    asyncio.run(main())


def test_stop_without_drain_answers_pending_with_batcher_closed() -> None:
    release = threading.Event()

    def model(x: torch.Tensor) -> torch.Tensor:
        release.wait(10)
        return x

    async def main() -> None:
        b = Batcher(model, max_batch_size=1, policy="none")
        await b.start()
        tasks = [asyncio.create_task(b.submit(torch.ones(1, 1))) for _ in range(3)]
        await async_wait_until(lambda: b.in_flight == 1 and b.queue_depth == 2,
                               "one request in flight (blocked) and two queued")
        stopping = asyncio.create_task(b.stop(drain=False))
        await async_wait_until(lambda: not b.running, "the batcher to stop accepting")
        release.set()
        await stopping
        outs = await asyncio.gather(*tasks, return_exceptions=True)
        assert torch.is_tensor(outs[0])  # in flight: completed
        assert all(isinstance(o, BatcherClosed) for o in outs[1:])

    asyncio.run(main())


# ----------------------------------------------------------------- padding and multi-input


def test_grouping_by_shape_never_mixes_shapes() -> None:
    calls: list[tuple[int, ...]] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return x.sum(dim=1, keepdim=True)

    async def main() -> None:
        async with Batcher(model, max_batch_size=16, policy="fixed:20") as b:
            xs = [torch.randn(1, 3 + i % 3) for i in range(12)]
            ys = await asyncio.gather(*(b.submit(x) for x in xs))
            for x, y in zip(xs, ys):
                torch.testing.assert_close(y, x.sum(dim=1, keepdim=True))
        assert all(len(s) == 2 for s in calls) and len(calls) >= 3

    asyncio.run(main())


def test_padding_pads_to_largest_and_cuts_answers_back() -> None:
    """A sequence model (output keeps the padded dim) gets its answer cut to its own length."""
    calls: list[tuple[int, ...]] = []

    def model(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(tuple(x.shape))
        return x * 2, x.sum(dim=1)  # per-position output, and a pooled one

    async def main() -> None:
        async with Batcher(model, max_batch_size=16, policy="fixed:30", pad=True, pad_value=0.0) as b:
            xs = [torch.randn(2, 2 + i) for i in range(5)]
            ys = await asyncio.gather(*(b.submit(x) for x in xs))
            for x, (per_pos, pooled) in zip(xs, ys):
                torch.testing.assert_close(per_pos, x * 2)
                torch.testing.assert_close(pooled, x.sum(dim=1))
        assert (10, 6) in calls  # one padded batch

    asyncio.run(main())


def test_multi_input_requests() -> None:
    def model(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = batch
        return a * b.sum(dim=1, keepdim=True)

    async def main() -> None:
        async with Batcher(model, max_batch_size=8) as b:
            pairs = [(torch.randn(2, 3), torch.randn(2, 4)) for _ in range(10)]
            ys = await asyncio.gather(*(b.submit(p) for p in pairs))
            for (x1, x2), y in zip(pairs, ys):
                torch.testing.assert_close(y, x1 * x2.sum(dim=1, keepdim=True))
            with pytest.raises(ValueError, match="same number"):
                await b.submit((torch.ones(2, 3), torch.ones(3, 4)))

    asyncio.run(main())


# ----------------------------------------------------------------- threads


def run_threads(target, n: int, timeout: float) -> None:
    """``target(k)`` in ``n`` threads at once, k = 0..n-1; returns when all ended (or ``timeout`` each)."""
    threads = [threading.Thread(target=target, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def test_threads_submit_blocking_under_random_arrivals() -> None:
    b = Batcher(MODEL, max_batch_size=16).start_background()
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        rng = random.Random(k)
        try:
            for j in range(25):
                time.sleep(rng.random() * 0.003)
                x = torch.randn(rng.randint(1, 3), 6)
                results[k * 100 + j] = (x, b.submit_blocking(x, timeout=30))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    run_threads(worker, 8, timeout=60)
    b.stop_background()
    assert not errors and len(results) == 200
    for x, y in results.values():
        torch.testing.assert_close(y, alone(x), rtol=1e-5, atol=1e-6)
    assert b.stats.answered == 200


def test_submit_blocking_timeout_never_runs_the_request() -> None:
    release = threading.Event()
    ran: list[float] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        ran.extend(x[:, 0].tolist())
        release.wait(10)
        return x

    b = Batcher(model, max_batch_size=1, policy="none").start_background()
    try:
        blocker = threading.Thread(target=b.submit_blocking, args=(torch.zeros(1, 1),))
        blocker.start()
        wait_until(lambda: b.in_flight == 1, "the blocking request in flight")
        with pytest.raises(TimeoutError):
            b.submit_blocking(torch.ones(1, 1), timeout=0.05)
        release.set()
        blocker.join(10)
    finally:
        b.stop_background()
    assert ran == [0.0]


def test_fixed_policy_validates() -> None:
    with pytest.raises(ValueError, match="max_wait"):
        FixedPolicy(-1)
    with pytest.raises(ValueError, match="max_batch_size"):
        Batcher(MODEL, max_batch_size=0)


def _gated_double_model() -> tuple[torch.nn.Module, object, threading.Event, threading.Event, list]:
    """A float64 model and a call that waits for ``gate`` (``entered`` is set when a call starts)."""
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double().eval()
    gate, entered, calls = threading.Event(), threading.Event(), []

    def call(x: torch.Tensor) -> torch.Tensor:
        calls.append((x.shape[0], threading.current_thread().name))
        entered.set()
        if not gate.wait(30):
            raise TimeoutError("the test never opened the gate")
        return net(x)

    return net, call, gate, entered, calls


@pytest.mark.parametrize("drain", [True, False])
def test_inline_runs_batches_on_the_loop_thread_dequeue_all_and_stops_refusing_at_once(drain: bool) -> None:
    net, call, gate, entered, calls = _gated_double_model()
    b = Batcher(call, max_batch_size=64, policy="none", inline=True, name="gated").start_background()
    xs = [torch.randn(1, 6, dtype=torch.float64) for _ in range(6)]
    first = b.submit_threadsafe(xs[0])
    wait_until(entered.is_set, "the first batch to start")
    waiting = [b.submit_threadsafe(x) for x in xs[1:]]
    assert b.queue_depth == 5  # in the inbox while the loop runs the batch, and counted
    stopper = threading.Thread(target=b.stop_background, kwargs={"drain": drain})
    stopper.start()
    wait_until(lambda: not b.running, "stop_background to refuse new requests during the batch")
    with pytest.raises(BatcherClosed):
        b.submit_threadsafe(xs[0])
    gate.set()
    stopper.join(30)
    assert not stopper.is_alive()
    with torch.inference_mode():
        torch.testing.assert_close(first.result(0), net(xs[0]), rtol=1e-12, atol=1e-12)
        for x, f in zip(xs[1:], waiting):
            if drain:
                torch.testing.assert_close(f.result(0), net(x), rtol=1e-12, atol=1e-12)
            else:
                with pytest.raises(BatcherClosed):
                    f.result(0)
    # the five handed over during the first batch made one batch (dequeue-all), on the loop's thread
    assert calls == ([(1, "batcher-loop-gated"), (5, "batcher-loop-gated")] if drain else [(1, "batcher-loop-gated")])


def test_inline_answers_equal_the_model_alone_under_threads() -> None:
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double().eval()
    b = Batcher(net, max_batch_size=16, policy="none", inline=True).start_background()
    results: dict[int, tuple[torch.Tensor, object]] = {}

    def producer(k: int) -> None:
        rng = torch.Generator().manual_seed(k)
        for j in range(50):
            x = torch.randn(1 + j % 3, 6, dtype=torch.float64, generator=rng)
            results[k * 100 + j] = (x, b.submit_threadsafe(x))

    run_threads(producer, 4, timeout=30)
    b.stop_background()
    assert len(results) == 200 and b.stats.answered == 200
    with torch.inference_mode():
        for x, f in results.values():
            torch.testing.assert_close(f.result(0), net(x), rtol=1e-12, atol=1e-12)


class _CountingFuture(concurrent.futures.Future):
    """Counts every attempt to set it (a second one raises, as any future's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set_result(self, result) -> None:
        self.sets += 1
        super().set_result(result)


@pytest.mark.parametrize("part", [False, True])
def test_answer_now_sets_each_future_once_and_the_batch_is_not_answered_again(part: bool) -> None:
    """``answer_now`` from ``run_batch`` (the online trainer's early predictions): callers get the early
    answer, not the batch's return value; with the whole batch, the batcher does not set them again."""
    gate, entered = threading.Event(), threading.Event()
    answered_before_return = []

    def run_batch(batch):
        entered.set()
        if not gate.wait(30):
            raise TimeoutError("the test never opened the gate")
        early = batch[: len(batch) - 1] if part else batch
        b.answer_now(early, [("early", p.payload) for p in early])
        answered_before_return.append(all(p.future.done() for p in early))
        return [("late", p.payload) for p in batch]

    b = Batcher(None, run_batch=run_batch, max_batch_size=64, policy="none", inline=True).start_background()
    first = _CountingFuture()
    b.hand_over(Pending((torch.zeros(1, 2),), 1, first, payload=-1, key=batch_key((torch.zeros(1, 2),), False)))
    wait_until(entered.is_set, "the first batch to start")
    futures = [_CountingFuture() for _ in range(5)]
    for i, f in enumerate(futures):  # one batch of 5, taken when the gate opens
        b.hand_over(Pending((torch.zeros(1, 2),), 1, f, payload=i, key=batch_key((torch.zeros(1, 2),), False)))
    gate.set()
    b.stop_background()
    assert answered_before_return == [True, True]
    assert b.stats.answered == 6 and b.in_flight == 0
    if part:  # the last of each batch was not answered early: it gets the batch's own answer
        assert first.result(0) == ("late", -1)
        assert [f.result(0) for f in futures] == [("early", i) for i in range(4)] + [("late", 4)]
        assert [f.sets for f in futures] == [2, 2, 2, 2, 1]  # the batch's second try finds them done
    else:
        assert first.result(0) == ("early", -1) and first.sets == 1
        assert [f.result(0) for f in futures] == [("early", i) for i in range(5)]
        assert [f.sets for f in futures] == [1] * 5
