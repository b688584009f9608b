"""``partrain loadtest URL``: load an Open Inference Protocol server and check its answers."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..cli import HelpFormatter
from ..errors import UsageError
from ..files import check_output_file
from .loadtest import LoadConfig, LoadReport, prepare, run_load
from .loadtest.generate import GenerateSettings


def _range(text: str) -> tuple[int, int]:
    """``"16:128"`` -> ``(16, 128)``; ``"32"`` -> ``(32, 32)``."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH or N, e.g. 16:128; got {text!r}") from None
    return bounds


# options of one kind of load only: naming one with the other kind is a mistake, not a no-op
_GENERATE_ONLY = ("prompt_tokens", "prompts", "max_tokens", "temperature", "top_p", "top_k", "ignore_eos")
_INFER_ONLY = ("binary", "shape", "npz", "atol")


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 1,1,28,28; got {text!r}") from None
    if not dims:
        raise argparse.ArgumentTypeError(f"expected sizes like 1,1,28,28; got {text!r}")
    return dims


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "loadtest",
        help="send load to an inference server, report throughput and latency, check every answer",
        description="Send inference requests (Open Inference Protocol v2) to a server, closed loop "
        "(--concurrency N clients) or open loop (--rate R requests/s), for --requests COUNT or "
        "--duration SECONDS. Reports throughput, p50/p90/p99 latency and errors by kind, checks that "
        "every request got exactly one answer and, with --check MODEL, that every answer is right. "
        "Inputs are random, shaped by the model's metadata (-1 sizes become 1, or use --shape), or "
        "come from --npz. With --generate, a generative model's /generate_stream route gets prompts of "
        "mixed lengths and reports output tokens/s, time to first token and time per output token "
        "(see the generation options). Exit status 1 when an answer is lost or wrong, or more requests "
        "fail than --max-error-rate allows (default: any). Needs the 'serve' extra: "
        "pip install 'partrain[serve]'.",
        epilog="Examples: partrain loadtest http://127.0.0.1:8000 --model lenet --concurrency 16 "
        "--duration 10 --check partrain.bench.serve:lenet_factory; "
        "partrain loadtest http://127.0.0.1:8000 --model gpt --generate --concurrency 32 --requests 200 "
        "--check gpt.pt",
        formatter_class=HelpFormatter)
    p.add_argument("url", metavar="URL", help="the server (http://HOST:PORT) or a model's URL "
                   "(http://HOST:PORT/v2/models/NAME)")
    p.add_argument("--model", "-m", help="the model's name on the server (unless in the URL)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", "-c", type=int, help="closed loop: N clients, each waits for its "
                      "answer before sending again (default 1)")
    load.add_argument("--rate", "-r", type=float, help="open loop: R requests per second whatever the "
                      "server does; latency counts from the scheduled arrival")
    p.add_argument("--arrivals", choices=("poisson", "uniform"), default="poisson",
                   help="open loop arrivals: Poisson (random gaps) or evenly spaced (default poisson)")
    p.add_argument("--requests", "-n", type=int, help="stop after COUNT requests")
    p.add_argument("--duration", "-d", type=float, help="stop sending after SECONDS (default 10 when "
                   "--requests is not given)")
    p.add_argument("--timeout", type=float, help="seconds each request may take (default 10; 60 with "
                   "--generate, for the whole stream)")
    p.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds the server may take to answer the first (metadata) query (default 5)")
    p.add_argument("--max-time", type=float, help="bound on the whole run in seconds (default: duration "
                   "+ 2 x timeout, or 600)")
    p.add_argument("--binary", action="store_true", help="send and receive tensors with the binary tensor "
                   "data extension instead of JSON")
    p.add_argument("--shape", type=_shape, help="shape of each request's input, e.g. 1,1,28,28 "
                   "(default: the metadata's, -1 sizes as 1)")
    p.add_argument("--npz", help="inputs from an .npz file: one array per input name (or one array); "
                   "each row is one request")
    p.add_argument("--samples", type=int, default=64, help="distinct random inputs (with --generate: "
                   "random prompts) to cycle through (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and arrivals")
    p.add_argument("--connections", type=int, help="open loop: HTTP connections shared by all requests "
                   "(default 256); closed loop: always one per client")
    p.add_argument("--check", metavar="MODEL", help="check every answer against MODEL run locally: a "
                   "partrain checkpoint, TorchScript or .pt2 file, or module:factory (as partrain serve). "
                   "With --generate, greedy answers only: the model alone runs once over the prompt and "
                   "the answer, and each answer token must be its most likely next token")
    p.add_argument("--atol", type=float, help="absolute tolerance of --check (default 1e-4)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance of --check (default 1e-4). "
                   "With --generate, the margin of a tie: the server's batched float32 arithmetic may differ "
                   "from the local run in the last bits, so an answer token that is not the local model's "
                   "choice but whose logit is within RTOL of the best one (relative to the larger, and at "
                   "least RTOL absolute) is reported as a tie, not a wrong answer")
    p.add_argument("--token", help="bearer token sent in the Authorization header")
    p.add_argument("--max-error-rate", type=float, default=0.0, metavar="FRACTION",
                   help="fail (exit status 1) when more than this fraction of requests get an error "
                   "(default 0: any failed request fails the run; 0.01 tolerates 1%%)")
    p.add_argument("--processes", type=int, default=1, help="client processes the load is spread over "
                   "(default 1): one tops out at a few thousand requests/s, less than a fast server answers; "
                   "the clients (or the rate) are dealt out and the reports merged")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON (its directory must "
                   "exist; checked before the load starts)")
    gen = p.add_argument_group("generation (--generate)")
    gen.add_argument("--generate", action="store_true", help="send generate requests to the model's "
                     "/generate_stream route (Server-Sent Events, one per token) and time every token: "
                     "TTFT, from the send (open loop: the scheduled arrival) to the first token; TPOT, "
                     "(last token's time - first token's) / (tokens - 1) per request")
    gen.add_argument("--prompt-tokens", type=_range, metavar="LOW:HIGH", help="prompt lengths, uniform in "
                     "the range; token ids drawn from the model's vocabulary (its metadata), seeded by "
                     "--seed (default 16:128)")
    gen.add_argument("--prompts", metavar="FILE", help="text prompts instead of random ids, one per line "
                     "(sent as text_input; the model needs a tokenizer)")
    gen.add_argument("--max-tokens", type=_range, metavar="LOW:HIGH", help="tokens to generate, uniform in "
                     "the range per prompt, capped so that prompt + max_tokens fits the model's context "
                     "(default 16:256)")
    gen.add_argument("--temperature", type=float, help="0 (the default) is greedy, the only kind --check "
                     "checks; above 0, tokens are sampled with a seed per prompt")
    gen.add_argument("--top-p", type=float, help="sampling: keep the most likely tokens up to this "
                     "probability (default 1: all)")
    gen.add_argument("--top-k", type=int, help="sampling: keep the K most likely tokens (default 0: all)")
    gen.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, help="generate max_tokens "
                     "tokens whatever the model's end-of-text token says (default: on for random ids, so "
                     "that lengths are what was asked; off for --prompts)")
    p.set_defaults(func=run, extra="serve")


def _check_kind(args: argparse.Namespace) -> None:
    """Options of the infer load with --generate, or generation options without it: one line."""
    wrong = _INFER_ONLY if args.generate else _GENERATE_ONLY
    given = [name for name in wrong if getattr(args, name) not in (None, False)]
    if args.generate and args.processes != 1:
        given.append("processes")
    if given:
        option = "--" + given[0].replace("_", "-")
        if args.generate:
            raise UsageError(f"Expected no {option} with --generate (it applies to infer requests). "
                             f"Received: {option}")
        raise UsageError(f"Expected --generate with {option} (a generation option). Received: {option} alone")


def settings_from_args(args: argparse.Namespace) -> GenerateSettings:
    """The generation options (defaults where not given)."""
    settings = GenerateSettings(prompts_file=args.prompts, ignore_eos=args.ignore_eos)
    for name in ("prompt_tokens", "max_tokens", "temperature", "top_p", "top_k"):
        if getattr(args, name) is not None:
            settings = dataclasses.replace(settings, **{name: getattr(args, name)})
    if args.prompts is not None and args.prompt_tokens is not None:
        raise UsageError("Expected one of --prompts (text) or --prompt-tokens (random ids). Received: both")
    settings.validate()
    return settings


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    _check_kind(args)
    concurrency = args.concurrency
    if concurrency is None and args.rate is None:
        concurrency = 1
    duration = args.duration
    if duration is None and args.requests is None:
        duration = 10.0
    for name in ("atol", "rtol"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            raise UsageError(f"Expected a non-negative --{name}. Received: {value}")
    if not 0 <= args.max_error_rate <= 1:
        raise UsageError(f"Expected --max-error-rate between 0 and 1. Received: {args.max_error_rate}")
    if args.json is not None:
        check_output_file(args.json, "--json")  # before the run: its results must not be lost
    if args.processes < 1:
        raise UsageError(f"Expected at least one client process. Received: --processes {args.processes}")
    if args.connections is not None and args.connections < 1:
        raise UsageError(f"Expected a positive number of connections. Received: --connections {args.connections}")
    return LoadConfig(
        url=args.url, model=args.model, concurrency=concurrency, rate=args.rate, arrivals=args.arrivals,
        requests=args.requests, duration=duration,
        timeout=args.timeout if args.timeout is not None else 60.0 if args.generate else 10.0,
        connect_timeout=args.connect_timeout, max_time=args.max_time, binary=args.binary,
        shape=args.shape, npz=args.npz, samples=args.samples, seed=args.seed,
        connections=args.connections,
        headers={"Authorization": f"Bearer {args.token}"} if args.token else {},
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.generate:
        return _run_generate(args, cfg)
    atol = args.atol if args.atol is not None else 1e-4
    info, samples, checker = prepare(cfg, args.check, atol=atol, rtol=args.rtol)
    if args.processes > 1:
        from .loadtest.processes import ClientProcesses

        with ClientProcesses(args.processes, samples, {"check": checker} if checker else {}) as clients:
            report, _ = clients.run(cfg, "check" if checker else None)
    else:
        report = run_load(cfg, samples=samples, checker=checker, info=info)
    print(f"model {info.name!r} at {cfg.url}, inputs "
          + ", ".join(f"{n} {list(a.shape)} {a.dtype}" for n, a in samples[0].items()))
    return _finish(args, report)


def _run_generate(args: argparse.Namespace, cfg: LoadConfig) -> int:
    from .loadtest.generate import describe, prepare_generate, run_generate

    settings = settings_from_args(args)
    model, prompts, checker = prepare_generate(cfg, settings, args.check, rtol=args.rtol)
    report = run_generate(cfg, settings, prompts, checker, describe(model, prompts, settings))
    print(f"model {model.name!r} at {cfg.url}, /generate_stream")
    return _finish(args, report)


def _finish(args: argparse.Namespace, report: LoadReport) -> int:
    """Print the report, write its figures (``--json``), say why the run failed: the exit status."""
    print(report.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.figures(), f, indent=2, sort_keys=True)
            f.write("\n")
    failures = report.failures(args.max_error_rate)
    for line in failures:
        print(f"partrain loadtest: FAILED: {line}", file=sys.stderr)
    return 1 if failures else 0
