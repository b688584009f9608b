"""Continuous batching: one decode step at a time over every running sequence.

`GenerationEngine` owns a `Runner` (the model over its KV cache slots) and one thread
that loops:

1. drop sequences whose caller went away (their slots free at once);
2. admit waiting requests into free slots, up to ``max_prefill_tokens`` of prompt per
   step, and prefill them together: each gets its first token now;
3. run one decode step over every running sequence (the new ones included), choose
   each one's next token, and end those that reached ``max_tokens``, the context's
   end, a stop string or an end-of-text token; their slots are reused by the next
   admission;
4. hand each caller its new tokens and text.

A request waits in the queue only while every slot is taken; beyond ``max_queue``
waiting requests `submit` raises `QueueFull` (the server's 503 with ``Retry-After``).
Nothing waits without bound: `stop` drains within its timeout and then ends what is
left with `BatcherClosed`.

Callers: ``submit(prompt, params, sink)`` from any thread (``sink(event)`` is called on
the engine's thread), ``stream`` from asyncio, ``generate`` blocking.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import torch

from ...batching import BatcherClosed, QueueFull
from .runners import Runner
from .sampling import (
    DEFAULT_MAX_TOKENS,
    RequestError,
    SamplingParams,
    choose_tokens,
    make_generator,
)
from .text import TextStream, Tokenizer

log = logging.getLogger(__name__)

DEFAULT_CACHE_BYTES = 1 << 30  # the KV cache's default budget: 1 GiB


@dataclass(frozen=True)
class Event:
    """What one step gives a caller: its new token (None on a last event that adds none),
    the text that became final, and once, ``finish_reason``: ``length`` (``max_tokens``
    or the context's end), ``stop`` (a stop string or end-of-text token), ``cancelled``
    or ``error`` (``error`` then says why)."""

    token: int | None
    text: str = ""
    finish_reason: str | None = None
    error: BaseException | None = None


@dataclass
class Completion:
    """A finished generation: the new token ids, their text (None without a tokenizer)."""

    tokens: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int


@dataclass(eq=False)
class _Sequence:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    sink: Callable[[Event], None]
    generator: torch.Generator | None
    text: TextStream | None
    stop_ids: frozenset[int]
    slot: int = -1
    length: int = 0  # tokens in the cache
    next_token: int | None = None  # chosen, not yet fed to the model
    generated: int = 0
    cancelled: bool = False
    done: bool = False


class Handle:
    """A submitted request: `cancel` frees its slot at the engine's next step."""

    def __init__(self, engine: GenerationEngine, seq: _Sequence) -> None:
        self._engine = engine
        self._seq = seq

    def cancel(self) -> None:
        self._engine._cancel(self._seq)


@dataclass
class EngineStats:
    steps: int = 0  # decode steps
    decoded_rows: int = 0  # sequences summed over decode steps (/ steps: the mean batch)
    prefills: int = 0
    prefill_tokens: int = 0
    generated: int = 0  # tokens handed out
    finished: int = 0
    peak_running: int = 0

    @property
    def mean_batch(self) -> float:
        return self.decoded_rows / self.steps if self.steps else 0.0


class GenerationEngine:
    """Continuous batching of decode steps over ``runner``'s KV cache (see the module doc).

    ``max_running`` sequences run at once, fewer when ``cache_bytes`` (default 1 GiB)
    holds fewer full-length sequences; ``max_queue`` requests may wait for a slot.
    ``tokenizer`` turns text into ids and back (None: ids only). ``seed`` seeds the
    draws of requests that bring no seed of their own.
    """

    def __init__(self, runner: Runner, tokenizer: Tokenizer | None = None, *, max_running: int = 32,
                 max_queue: int = 256, cache_bytes: int | None = None, max_prefill_tokens: int = 2048,
                 name: str = "model", seed: int | None = None,
                 on_step: Callable[[int, float], None] | None = None) -> None:
        for key, value in (("max_running", max_running), ("max_queue", max_queue),
                           ("max_prefill_tokens", max_prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Expected {key} >= 1. Received: {key}={value!r}")
        budget = DEFAULT_CACHE_BYTES if cache_bytes is None else cache_bytes
        per_slot = runner.bytes_per_slot()
        if budget < per_slot:
            raise ValueError(f"Expected a KV cache budget of at least one sequence of {runner.block_size} tokens, "
                             f"{per_slot} bytes. Received: cache_bytes={budget}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_running = min(max_running, budget // per_slot)
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self.name = name
        self.on_step = on_step
        self.stats = EngineStats()
        self._fallback = torch.Generator()
        self._fallback.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        self._cond = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []  # running[i].slot == i
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._closing = False
        self._drain = True

    # ------------------------------------------------------------ lifecycle

    @property
    def running(self) -> bool:
        """Accepting requests (started, not stopping)."""
        return self._accepting

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Sequences holding a cache slot."""
        return len(self._running)

    def start(self) -> GenerationEngine:
        if self._thread is not None:
            raise RuntimeError(f"Generation engine {self.name!r} is already started")
        self.runner.allocate(self.max_running)
        self._accepting = True
        self._thread = threading.Thread(target=self._loop, name=f"generate-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Refuse new requests; with ``drain``, finish the accepted ones within ``timeout``
        seconds. What is left then ends with `BatcherClosed`."""
        with self._cond:
            self._accepting = False
            self._closing = True
            self._drain = drain
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # the drain ran out of time: end the rest from here
                with self._cond:
                    self._drain = False
                    self._cond.notify_all()
                self._thread.join(timeout)
            self._thread = None

    async def astop(self, drain: bool = True, timeout: float = 60.0) -> None:
        await asyncio.to_thread(self.stop, drain, timeout)

    # ------------------------------------------------------------ callers

    def check(self, prompt: Sequence[int], params: SamplingParams) -> int:
        """The request's ``max_tokens`` as it will run; `RequestError` (one line) when it cannot."""
        block, vocab = self.runner.block_size, self.runner.vocab_size
        if not prompt:
            raise RequestError("Expected a prompt of at least one token. Received: an empty prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            bad = next(t for t in prompt if isinstance(t, bool) or not isinstance(t, int))
            raise RequestError(f"Expected integer token ids. Received: {bad!r}")
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= vocab:
            raise RequestError(f"Expected token ids in [0, {vocab}) for model {self.name!r}. Received: ids in "
                               f"[{lo}, {hi}]")
        if len(prompt) >= block:
            raise RequestError(f"Expected a prompt shorter than the context of model {self.name!r}, {block} tokens "
                               f"(room for one new token at least). Received: {len(prompt)} tokens")
        if params.max_tokens is None:
            return min(DEFAULT_MAX_TOKENS, block - len(prompt))
        if len(prompt) + params.max_tokens > block:
            raise RequestError(f"Expected prompt + max_tokens <= the context of model {self.name!r}, {block} tokens. "
                               f"Received: {len(prompt)} + {params.max_tokens} = {len(prompt) + params.max_tokens}")
        return params.max_tokens

    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Callable[[Event], None]) -> Handle:
        """Queue a generation; ``sink(event)`` gets its events on the engine's thread.

        Raises `RequestError` (bad prompt or parameters), `QueueFull` (``max_queue``
        requests wait) or `BatcherClosed` (stopping or not started).
        """
        prompt = list(prompt)
        max_tokens = self.check(prompt, params)
        tok = self.tokenizer
        if params.stop and tok is None:
            raise RequestError(f"Expected no stop strings for model {self.name!r}: it has no tokenizer to read "
                               f"text with. Received: stop={list(params.stop)!r} (use stop_token_ids)")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(tok.eos_token_ids if tok is not None else self.runner.eos_token_ids)
        seq = _Sequence(prompt=prompt, params=params, max_tokens=max_tokens, sink=sink,
                        generator=None if params.greedy else make_generator(params.seed, self._fallback),
                        text=TextStream(tok, params.stop) if tok is not None else None,
                        stop_ids=frozenset(stop_ids))
        with self._cond:
            if not self._accepting:
                raise BatcherClosed(f"Model {self.name!r} is not accepting requests (stopping or not started)")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"Expected at most {self.max_queue} requests waiting for model {self.name!r}. "
                                f"Received: one more while {len(self._running)} run and {len(self._waiting)} wait")
            self._waiting.append(seq)
            self._cond.notify()
        return Handle(self, seq)

    async def stream(self, prompt: Sequence[int], params: SamplingParams) -> AsyncIterator[Event]:
        """The request's events as they come; leaving the iteration early cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        handle = self.submit(prompt, params, sink)
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finish_reason is not None
                yield event
        finally:
            if not finished:
                handle.cancel()

    def generate(self, prompt: Sequence[int] | str, params: SamplingParams | None = None,
                 timeout: float | None = 600.0) -> Completion:
        """Run one request to its end from a plain thread; a text prompt needs a tokenizer."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"Expected token ids for model {self.name!r}: it has no tokenizer. Received: text")
            prompt = self.tokenizer.encode(prompt)
        events: list[Event] = []
        done = threading.Event()

        def sink(event: Event) -> None:
            events.append(event)
            if event.finish_reason is not None:
                done.set()

        handle = self.submit(prompt, params, sink)
        if not done.wait(timeout):
            handle.cancel()
            raise TimeoutError(f"Generation of model {self.name!r} did not finish within {timeout} s")
        return completion(events, len(prompt), self.tokenizer is not None)

    # ------------------------------------------------------------ the engine's thread

    def _cancel(self, seq: _Sequence) -> None:
        with self._cond:
            seq.cancelled = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._closing):
                    self._cond.wait()
                if self._closing and (not self._drain or not (self._waiting or self._running)):
                    left = [*self._running, *self._waiting]
                    self._running, self._waiting = [], deque()
                    break
                cancelled = [s for s in self._waiting if s.cancelled]
                for s in cancelled:
                    self._waiting.remove(s)
                admitted = self._admit()
            events: list[tuple[_Sequence, Event]] = [(s, Event(None, finish_reason="cancelled")) for s in cancelled]
            for s in self._running:
                if s.cancelled:
                    events.append((s, Event(None, finish_reason="cancelled")))
                    s.done = True
            try:
                self._release()
                admitted = [s for s in admitted if not s.done]
                if admitted:
                    self._prefill(admitted, events)
                    self._release()  # those that ended at their first token leave before the decode step
                if self._running:
                    self._decode(events)
            except Exception as exc:  # noqa: BLE001 - the model failed: end the sequences of this step
                log.exception("generation step of model %r failed", self.name)
                for s in [*self._running, *admitted]:
                    if not s.done:
                        s.done = True
                        events.append((s, Event(None, finish_reason="error", error=exc)))
                self._running = []
            self._release()
            self._dispatch(events)
        closed = BatcherClosed(f"Model {self.name!r} stopped before this request finished")
        self._dispatch([(s, Event(None, finish_reason="error", error=closed)) for s in left])

    def _admit(self) -> list[_Sequence]:
        """Waiting requests that get a slot this step (under the lock)."""
        admitted: list[_Sequence] = []
        tokens = 0
        while self._waiting and len(self._running) < self.max_running:
            nxt = self._waiting[0]
            if admitted and tokens + len(nxt.prompt) > self.max_prefill_tokens:
                break
            self._waiting.popleft()
            nxt.slot = len(self._running)
            self._running.append(nxt)
            admitted.append(nxt)
            tokens += len(nxt.prompt)
        self.stats.peak_running = max(self.stats.peak_running, len(self._running))
        return admitted

    def _release(self) -> None:
        """Free the slots of finished sequences, moving the last running ones into them."""
        running = self._running
        i = 0
        while i < len(running):
            if not running[i].done:
                i += 1
                continue
            while running and running[-1].done:  # finished at the end: nothing to move
                running.pop()
            if i < len(running):  # running[i] finished, the last one did not: it takes slot i
                last = running.pop()
                self.runner.move(last.slot, i, last.length)
                last.slot = i
                running[i] = last
                i += 1

    def _prefill(self, seqs: list[_Sequence], events: list[tuple[_Sequence, Event]]) -> None:
        logits = self.runner.prefill([s.prompt for s in seqs], [s.slot for s in seqs])
        for s in seqs:
            s.length = len(s.prompt)
        self.stats.prefills += 1
        self.stats.prefill_tokens += sum(s.length for s in seqs)
        self._choose(seqs, logits, events)

    def _decode(self, events: list[tuple[_Sequence, Event]]) -> None:
        seqs = self._running
        started = time.perf_counter()
        logits = self.runner.decode([s.next_token for s in seqs], [s.length for s in seqs])
        for s in seqs:
            s.length += 1
        self.stats.steps += 1
        self.stats.decoded_rows += len(seqs)
        self._choose(seqs, logits, events)
        if self.on_step is not None:
            self.on_step(len(seqs), time.perf_counter() - started)

    def _choose(self, seqs: list[_Sequence], logits: torch.Tensor, events: list[tuple[_Sequence, Event]]) -> None:
        tokens = choose_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs])
        for s, token in zip(seqs, tokens):
            s.generated += 1
            self.stats.generated += 1
            if token in s.stop_ids:
                text = s.text.finish() if s.text is not None else ""
                events.append((s, Event(None, text, "stop")))
                s.done = True
                continue
            text = s.text.push(token) if s.text is not None else ""
            if s.text is not None and s.text.stopped:
                events.append((s, Event(token, text, "stop")))
                s.done = True
            elif s.generated >= s.max_tokens:
                events.append((s, Event(token, text + (s.text.finish() if s.text is not None else ""), "length")))
                s.done = True
            else:
                events.append((s, Event(token, text)))
                s.next_token = token

    def _dispatch(self, events: list[tuple[_Sequence, Event]]) -> None:
        for s, event in events:
            if event.finish_reason is not None:
                self.stats.finished += 1
            try:
                s.sink(event)
            except Exception:  # noqa: BLE001 - a caller that is gone (its loop closed): end its sequence
                log.debug("a generation caller of model %r is gone", self.name, exc_info=True)
                s.cancelled = True


def completion(events: Sequence[Event], prompt_tokens: int, has_text: bool) -> Completion:
    """The `Completion` a request's events add up to (its last event carries the finish reason)."""
    last = events[-1]
    if last.finish_reason == "error":
        raise last.error if last.error is not None else RuntimeError("generation failed")
    tokens = [e.token for e in events if e.token is not None]
    text = "".join(e.text for e in events) if has_text else None
    return Completion(tokens=tokens, text=text, finish_reason=last.finish_reason or "length",
                      prompt_tokens=prompt_tokens)
