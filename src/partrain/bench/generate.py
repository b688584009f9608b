"""Generate: partrain serve's continuous batching against one-at-a-time, request-level batching and HF generate.

The workload is a causal language model served to many users: the built-in GPT (6
layers of width 384, 6 heads, a 512-token context, byte vocabulary: about 10.9M
parameters; random weights, seeded, so every process builds the same ones) and a fixed
list of requests (seeded): prompts of 16-128 random tokens, each asking for 16-256 new
tokens (uniform), greedy, end-of-text ignored, so every request runs to its
``max_tokens``. Four variants serve it in alternating rounds (every variant once per
round, the turn order rotating), each one's figure the tokens it generated per second
of wall time:

  partrain          ``partrain serve`` of the GPT (a server process, torch threads = the
                    cores), ``POST /v2/models/gpt/generate``, 32 concurrent clients (closed
                    loop: each sends its next request when its answer came); continuous
                    batching: one decode step over every running sequence, a new request
                    joining at the next step, a finished one leaving at once
  sequential        the loop a user writes: one request at a time, prefill the prompt, then
                    one token per forward pass over a KV cache (`GPTRunner` with one slot: the
                    engine's own model math), in this process with the same threads
  static            request-level batching: the project's `Batcher` collects up to 32
                    requests of the same 32 concurrent callers and holds each batch until its
                    longest request ends (prefilled together, every row decoded to the batch's
                    largest max_tokens over a KV cache, each answer cut to its own length)
  hf                Hugging Face ``GPT2LMHeadModel.generate`` (its own KV cache) on a GPT-2 of
                    the same shape and weights, one request at a time (skipped, with a line,
                    without ``transformers``: the ``hf`` extra)

The one-at-a-time variants serve fewer requests per round than the batched ones (the
first N of the same list: the figure is a rate, and a round of each stays a few seconds).

Latency at half of saturation: after the rounds, requests arrive open loop (Poisson, at
half of the partrain variant's closed-loop request rate, median over rounds) on
``/generate_stream``; time to first token (TTFT) runs from a request's scheduled arrival
to its first streamed token, time per output token (TPOT) from there to its last.

Goals: generate.vs_sequential (partrain / sequential tokens/s, round by round) >= 5,
generate.vs_static (partrain / static) >= 1.5, generate.ttft_p99_over_p50 (open loop, half
of saturation) <= 3, generate.vs_hf (partrain / hf) >= 5. Checks: every greedy answer of
the partrain variant equals the sequential loop's for the same request (float32 arithmetic
in batches of different shapes may flip a near-tie: a count is reported, and more than 5%
different answers fail the run); no request refused, lost or cut short.

``--in-process`` drives the engine (`GenerationEngine`) in this process instead of over
HTTP (the engine alone); without the ``serve`` extra that is what runs, said in one line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import math
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..env import available_cores
from ..errors import RunFailed
from ..models.gpt import GPT
from ..tables import format_number
from ._generate_baselines import (
    Request,
    Run,
    StaticBatching,
    hf_sequential,
    hf_twin,
    make_requests,
    sequential,
)
from ._generate_load import Client, EngineClient, HTTPClient, OpenLoop, closed_loop, open_loop
from .harness import (
    Report,
    Spread,
    alternate,
    paired_ratio,
    pick_size,
    positive_int,
    server_process,
    torch_threads,
)

MODEL_NAME = "gpt"
VOCAB = 256  # bytes
MISMATCH_LIMIT_PCT = 5.0  # more greedy answers than this differing from the sequential loop's: the run fails
ANNOUNCE = re.compile(r"serving .* at (?P<url>https?://[^\s/]+)")  # partrain serve's line once it listens


@dataclass(frozen=True)
class Shape:
    """The GPT's size."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int


@dataclass(frozen=True)
class Size:
    shape: Shape
    prompt_lengths: tuple[int, int]  # inclusive range, uniform
    output_lengths: tuple[int, int]  # max_tokens, inclusive range, uniform
    clients: int  # concurrent callers of the batched variants (and the engine's running sequences)
    batched_requests: int  # per round, partrain and static
    sequential_requests: int  # per round, the sequential loop
    hf_requests: int  # per round, Hugging Face generate
    open_loop_requests: int
    rounds: int


GPT_SHAPE = Shape(6, 6, 384, 512)
TOY_SHAPE = Shape(2, 2, 32, 64)
FULL = Size(GPT_SHAPE, (16, 128), (16, 256), 32, 96, 8, 8, 200, 3)
QUICK = Size(GPT_SHAPE, (16, 128), (16, 256), 32, 64, 4, 4, 30, 1)
TOY = Size(TOY_SHAPE, (4, 16), (4, 16), 4, 8, 4, 2, 6, 1)


def _gpt(shape: Shape) -> GPT:
    torch.manual_seed(0)  # every process (this one, the server) builds the same weights
    return GPT(vocab_size=VOCAB, n_layer=shape.n_layer, n_head=shape.n_head, n_embd=shape.n_embd,
               block_size=shape.block_size).eval()


def gpt_factory() -> GPT:
    """The benchmark's GPT (about 10.9M parameters, seeded): what ``partrain serve`` is given."""
    return _gpt(GPT_SHAPE)


def toy_gpt_factory() -> GPT:
    """The toy run's GPT (two layers of width 32)."""
    return _gpt(TOY_SHAPE)


FACTORIES = {GPT_SHAPE: "partrain.bench.generate:gpt_factory", TOY_SHAPE: "partrain.bench.generate:toy_gpt_factory"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default 3; --quick 1)")
    p.add_argument("--clients", type=positive_int, default=None,
                   help="concurrent callers of the batched variants, and the engine's running sequences (default 32)")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="requests per round of the batched variants (default 96; --quick 64)")
    p.add_argument("--sequential-requests", type=positive_int, default=None,
                   help="requests per round of the one-at-a-time variants, sequential and hf (default 8; --quick 4)")
    p.add_argument("--open-loop-requests", type=positive_int, default=None,
                   help="requests of the open-loop latency run (default 200; --quick 30)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads of the server and of this process's variants (default: the cores)")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    p.add_argument("--in-process", action="store_true",
                   help="drive the engine in this process instead of over HTTP (the engine alone)")
    p.add_argument("--start-timeout", type=float, default=120.0,
                   help="seconds the server may take to become ready (default 120)")


def _size(args: argparse.Namespace) -> tuple[Size, bool]:
    size, smoke = pick_size(args, FULL, QUICK, TOY)
    one_at_a_time = args.sequential_requests
    size = replace(size, rounds=args.rounds or size.rounds, clients=args.clients or size.clients,
                   batched_requests=args.requests or size.batched_requests,
                   sequential_requests=one_at_a_time or size.sequential_requests,
                   hf_requests=one_at_a_time or size.hf_requests,
                   open_loop_requests=args.open_loop_requests or size.open_loop_requests)
    return size, smoke


# --------------------------------------------------------------------------- the run


@contextlib.contextmanager
def partrain_variant(model: GPT, size: Size, threads: int, args: argparse.Namespace,
                     report: Report) -> Iterator[Callable[[], contextlib.AbstractAsyncContextManager[Client]]]:
    """The partrain variant's clients: `HTTPClient` on a ``partrain serve`` process, or (``--in-process``,
    or no ``serve`` extra) `EngineClient` on an engine here. Yields a factory of async sessions (one per
    event loop: each round runs its own)."""
    serve_extra = all(importlib.util.find_spec(m) is not None for m in ("uvicorn", "starlette", "httpx"))
    if not args.in_process and not serve_extra:
        report.note("partrain serve: the 'serve' extra is missing (pip install 'partrain[serve]'); the partrain "
                    "variant runs the engine in this process, without HTTP")
    if args.in_process or not serve_extra:
        from ..serve.generation import GenerationEngine, GPTRunner

        engine = GenerationEngine(GPTRunner(model), max_running=size.clients, max_queue=4 * size.clients,
                                  name=MODEL_NAME).start()

        @contextlib.asynccontextmanager
        async def engine_session() -> AsyncIterator[Client]:
            yield EngineClient(engine)

        try:
            yield engine_session
        finally:
            engine.stop(drain=False)
        return
    import httpx

    command = (sys.executable, "-m", "partrain", "serve", f"{MODEL_NAME}={FACTORIES[size.shape]}",
               "--host", "127.0.0.1", "--port", "0", "--threads", str(threads),
               "--max-running", str(size.clients), "--max-queue", str(4 * size.clients))
    with server_process("partrain serve", command, ANNOUNCE, ready_path="/v2/health/ready",
                        start_timeout=args.start_timeout) as server:

        @contextlib.asynccontextmanager
        async def http_session() -> AsyncIterator[Client]:
            limits = httpx.Limits(max_connections=size.clients + 8, max_keepalive_connections=size.clients + 8)
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=600.0, trust_env=False) as http:
                yield HTTPClient(http, MODEL_NAME)

        yield http_session


def run(args: argparse.Namespace) -> Report:
    size, smoke = _size(args)
    threads = args.threads or available_cores()
    report = Report("generate", smoke=smoke)
    model = _gpt(size.shape)
    parameters = sum(p.numel() for p in model.parameters())
    requests = make_requests(max(size.batched_requests, size.sequential_requests, size.hf_requests),
                             size.prompt_lengths, size.output_lengths, VOCAB)
    s = size.shape
    report.say(f"partrain bench generate: GPT {s.n_layer} layers x {s.n_embd} ({s.n_head} heads, "
               f"{format_number(parameters / 1e6)}M parameters, context {s.block_size}), random weights (seeded); prompts "
               f"{size.prompt_lengths[0]}-{size.prompt_lengths[1]} tokens, max_tokens {size.output_lengths[0]}-"
               f"{size.output_lengths[1]} (uniform, greedy, end-of-text ignored); {size.clients} concurrent clients "
               f"of the batched variants; {size.rounds} alternating round(s); {threads} torch thread(s) per process, "
               f"{available_cores()} cores, torch {torch.__version__}")
    report.say(f"per round: partrain and static serve {size.batched_requests} requests, sequential "
               f"{size.sequential_requests} and hf {size.hf_requests} (the first of the same list: the figure is a "
               "rate)")
    report.figure("parameters", parameters)
    twin = _hf(model, args, report)
    with torch_threads(threads), partrain_variant(model, size, threads, args, report) as session:
        static = StaticBatching(model, size.clients)
        try:
            runs, open_run = _measure(model, twin, static, session, requests, size, report)
        finally:
            static.close()
    _report(report, runs, open_run, args)
    return report


def _hf(model: GPT, args: argparse.Namespace, report: Report) -> Any:
    if args.no_hf:
        report.note("hf: skipped (--no-hf); generate.vs_hf not measured")
        return None
    if importlib.util.find_spec("transformers") is None:
        report.note("hf: transformers is not installed (pip install 'partrain[hf]'); generate.vs_hf not measured")
        return None
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generate's notes on its defaults: not this benchmark's output
    return hf_twin(model)


PARTRAIN, SEQUENTIAL, STATIC, HF = ("partrain serve, continuous batching", "sequential loop, KV cache",
                                    "static batching (Batcher)", "Hugging Face generate, one at a time")
KEYS = {PARTRAIN: "partrain", SEQUENTIAL: "sequential", STATIC: "static", HF: "hf"}  # figure names in --json


def _measure(model: GPT, twin: Any, static: StaticBatching, session: Callable[[], Any], requests: list[Request],
             size: Size, report: Report) -> tuple[dict[str, list[Run]], OpenLoop]:
    batched, one_by_one = requests[:size.batched_requests], requests[:size.sequential_requests]

    async def closed(generate_of: Callable[[Client], Callable[[Request], Awaitable[list[int]]]],
                     items: Sequence[Request], clients: int) -> Run:
        async with session() as client:
            return await closed_loop(generate_of(client), items, clients)

    def partrain_run(items: Sequence[Request] = batched) -> Run:
        return asyncio.run(closed(lambda c: c.generate, items, size.clients))

    def static_run(items: Sequence[Request] = batched) -> Run:
        return asyncio.run(closed(lambda _: static.generate, items, size.clients))

    variants: dict[str, Callable[[], Run]] = {
        PARTRAIN: partrain_run,
        SEQUENTIAL: functools.partial(sequential, model, one_by_one),
        STATIC: static_run,
    }
    if twin is not None:
        variants[HF] = functools.partial(hf_sequential, twin, requests[:size.hf_requests])
    # warm-up: first calls, thread pools, the batcher's latency estimates; not measured
    report.progress("warm-up")
    warm = [replace(r, max_tokens=min(r.max_tokens, 8)) for r in requests[:size.clients]]
    partrain_run(warm)
    static_run(warm)
    sequential(model, warm[:2])
    if twin is not None:
        hf_sequential(twin, warm[:2])
    runs = alternate(variants, size.rounds, on_result=lambda r, name, v: report.progress(
        f"round {r + 1}: {name}: {v.tokens_per_s:,.0f} tokens/s ({len(v.answers)} requests, {v.seconds:.1f} s)"))
    rate = 0.5 * Spread.of([r.requests_per_s for r in runs[PARTRAIN]]).median
    if not rate > 0:  # no partrain request was answered: nothing to pace the open loop by
        return runs, OpenLoop(math.nan, Run(0, 0.0))
    report.progress(f"open loop: {size.open_loop_requests} requests arriving at {rate:.2f}/s (half of partrain's "
                    "closed-loop rate)")

    async def opened() -> OpenLoop:
        async with session() as client:
            return await open_loop(client.stream, batched, size.open_loop_requests, rate)

    return runs, asyncio.run(opened())


def _mismatches(runs: Sequence[Run], reference: dict[int, tuple[int, ...]]) -> tuple[int, int]:
    """(answers compared, answers different) of ``runs`` against the reference's answers of the same requests."""
    compared = different = 0
    for r in runs:
        for i, answer in r.answers.items():
            if i in reference:
                compared += 1
                different += answer != reference[i]
    return compared, different


def _report(report: Report, runs: dict[str, list[Run]], open_run: OpenLoop, args: argparse.Namespace) -> None:
    rates = {name: [r.tokens_per_s for r in rs] for name, rs in runs.items()}
    ours = rates[PARTRAIN]
    ratios = {name: paired_ratio(ours, rates[name]) for name in rates if name != PARTRAIN}
    rows = []
    for name, rs in runs.items():
        spread = Spread.of(rates[name])
        key = KEYS[name]
        report.figure(f"{key}.tokens_per_s", spread)
        report.figure(f"{key}.requests_per_round", len(rs[0].answers) + rs[0].errors)
        rows.append([name, len(rs[0].answers) + rs[0].errors, spread.cell(),
                     ratios[name].cell() if name in ratios else ""])
        if name in ratios:
            report.figure(f"partrain_over_{key}", ratios[name])
    report.table(["variant", "requests/round", "tokens/s median (min-max)", "partrain / this"], rows)

    ttft, tpot = open_run.ttft, open_run.tpot
    p50, p99 = open_run.percentile(ttft, 50), open_run.percentile(ttft, 99)
    tail = p99 / p50 if p50 > 0 else math.nan
    report.table(["arrivals/s", "requests", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "p99 / p50", "TPOT p50 ms",
                  "TPOT p99 ms"],
                 [[open_run.rate, len(open_run.run.answers), open_run.run.tokens_per_s, p50 * 1e3, p99 * 1e3, tail,
                   open_run.percentile(tpot, 50) * 1e3, open_run.percentile(tpot, 99) * 1e3]],
                 title="partrain, open loop at half of saturation (Poisson arrivals; TTFT from the scheduled arrival)")
    for k, v in (("rate_per_s", open_run.rate), ("ttft_p50_ms", p50 * 1e3), ("ttft_p99_ms", p99 * 1e3),
                 ("tpot_p50_ms", open_run.percentile(tpot, 50) * 1e3),
                 ("tpot_p99_ms", open_run.percentile(tpot, 99) * 1e3), ("tokens_per_s", open_run.run.tokens_per_s)):
        report.figure(f"open_loop.{k}", v)

    reference = runs[SEQUENTIAL][0].answers
    checked = {PARTRAIN: [*runs[PARTRAIN], open_run.run], STATIC: runs[STATIC], HF: runs.get(HF, [])}
    rows, ours_pct = [], math.nan
    for name, rs in checked.items():
        if not rs:
            continue
        compared, different = _mismatches(rs, reference)
        pct = 100.0 * different / compared if compared else math.nan
        rows.append([name, compared, different, format_number(pct)])
        report.figure(f"{KEYS[name]}.greedy_mismatches", different)
        if name == PARTRAIN:
            ours_pct = pct
    report.table(["variant", "answers compared", "different", "%"], rows,
                 title=f"greedy answers against the sequential loop's ({len(reference)} requests, every round)")

    failed = {name: sum(r.errors + r.short for r in rs) for name, rs in
              {**runs, "open loop": [open_run.run]}.items()}
    for name, count in failed.items():
        report.figure(f"{KEYS.get(name, 'open_loop')}.failed_requests", count)
    first_error = next((r.first_error for rs in [*runs.values(), [open_run.run]] for r in rs if r.first_error), None)
    if first_error:
        report.note(f"first failed request: {first_error}")

    report.goal("generate.vs_sequential", ratios[SEQUENTIAL], ">=", 5.0,
                "partrain / sequential loop with a KV cache, tokens/s")
    report.goal("generate.vs_static", ratios[STATIC], ">=", 1.5,
                "partrain / request-level batching (Batcher), tokens/s")
    report.goal("generate.ttft_p99_over_p50", tail if ttft else None, "<=", 3.0,
                "TTFT p99 / p50, open loop at half of saturation")
    report.goal("generate.vs_hf", ratios.get(HF), ">=", 5.0, "partrain / Hugging Face generate one by one, tokens/s")
    report.check("generate.greedy_mismatch_pct", None if math.isnan(ours_pct) else ours_pct, "<=",
                 MISMATCH_LIMIT_PCT, "partrain's greedy answers differing from the sequential loop's, %")
    report.check("generate.failed_requests", float(sum(failed.values())), "<=", 0.0,
                 "requests refused, lost or cut short, every variant")
    answered = any(r.answers for r in runs[PARTRAIN])
    if not answered or ours_pct > MISMATCH_LIMIT_PCT:  # NaN (nothing compared) is not above it
        report.finish()  # the tables and goals are out, the JSON written: the run must still not exit 0
        report.write_json(args.json)
        raise RunFailed(f"partrain's greedy answers differ from the sequential loop's for {format_number(ours_pct)}% "
                        f"of the answers compared (more than {MISMATCH_LIMIT_PCT:g}%)" if answered
                        else f"every request of the partrain variant failed ({first_error})")
