"""``partrain loadtest URL``: load an Open Inference Protocol server and check its answers."""

from __future__ import annotations

import argparse
import json
import sys

from ..cli import HelpFormatter
from ..errors import UsageError
from ..files import check_output_file
from .loadtest import LoadConfig, prepare, run_load


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
        "come from --npz. Exit status 1 when an answer is lost or wrong, or more requests fail than "
        "--max-error-rate allows (default: any). Needs the 'serve' extra: pip install 'partrain[serve]'.",
        epilog="Example: partrain loadtest http://127.0.0.1:8000 --model lenet --concurrency 16 "
        "--duration 10 --check partrain.bench.serve:lenet_factory",
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
    p.add_argument("--timeout", type=float, default=10.0, help="seconds each request may take (default 10)")
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
    p.add_argument("--samples", type=int, default=64, help="distinct random inputs to cycle through "
                   "(default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and arrivals")
    p.add_argument("--connections", type=int, help="open loop: HTTP connections shared by all requests "
                   "(default 256); closed loop: always one per client")
    p.add_argument("--check", metavar="MODEL", help="check every answer against MODEL run locally: a "
                   "partrain checkpoint, TorchScript or .pt2 file, or module:factory (as partrain serve)")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance of --check (default 1e-4)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance of --check (default 1e-4)")
    p.add_argument("--token", help="bearer token sent in the Authorization header")
    p.add_argument("--max-error-rate", type=float, default=0.0, metavar="FRACTION",
                   help="fail (exit status 1) when more than this fraction of requests get an error "
                   "(default 0: any failed request fails the run; 0.01 tolerates 1%%)")
    p.add_argument("--processes", type=int, default=1, help="client processes the load is spread over "
                   "(default 1): one tops out at a few thousand requests/s, less than a fast server answers; "
                   "the clients (or the rate) are dealt out and the reports merged")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON (its directory must "
                   "exist; checked before the load starts)")
    p.set_defaults(func=run, extra="serve")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    concurrency = args.concurrency
    if concurrency is None and args.rate is None:
        concurrency = 1
    duration = args.duration
    if duration is None and args.requests is None:
        duration = 10.0
    for name in ("atol", "rtol"):
        if not getattr(args, name) >= 0:
            raise UsageError(f"Expected a non-negative --{name}. Received: {getattr(args, name)}")
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
        requests=args.requests, duration=duration, timeout=args.timeout,
        connect_timeout=args.connect_timeout, max_time=args.max_time, binary=args.binary,
        shape=args.shape, npz=args.npz, samples=args.samples, seed=args.seed,
        connections=args.connections,
        headers={"Authorization": f"Bearer {args.token}"} if args.token else {},
    )


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    info, samples, checker = prepare(cfg, args.check, atol=args.atol, rtol=args.rtol)
    if args.processes > 1:
        from .loadtest.processes import ClientProcesses

        with ClientProcesses(args.processes, samples, {"check": checker} if checker else {}) as clients:
            report, _ = clients.run(cfg, "check" if checker else None)
    else:
        report = run_load(cfg, samples=samples, checker=checker, info=info)
    print(f"model {info.name!r} at {cfg.url}, inputs "
          + ", ".join(f"{n} {list(a.shape)} {a.dtype}" for n, a in samples[0].items()))
    print(report.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.figures(), f, indent=2, sort_keys=True)
            f.write("\n")
    failures = report.failures(args.max_error_rate)
    for line in failures:
        print(f"partrain loadtest: FAILED: {line}", file=sys.stderr)
    return 1 if failures else 0
