"""``partrain rl train|serve|act``: an actor-learner run on gymnasium environments.

- ``rl serve``: a learner on ``--env``; prints its URL, trains on the segments actors send.
- ``rl act URL``: one actor (any process may run it, anywhere that reaches URL).
- ``rl train``: a learner plus ``--actors`` actor processes, each started as ``rl act URL``.

Output follows ``partrain train``: ``OUT/metrics.csv``, ``OUT/metrics.jsonl``,
``OUT/curves.png`` (return, frames/s, policy lag, loss) and ``OUT/checkpoint.pt``.
See docs/rl.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from typing import Any

from ..cli import HelpFormatter
from ..env import check_device
from ..errors import UsageError
from ..extras import needs
from ..files import run_dir

DEFAULT_OUT = "runs/rl"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "rl", help="actor-learner reinforcement learning: a live model shared with actor processes",
        description="Actor-learner runtime: a learner trains on experience sent by actor processes and "
                    "publishes each update as a version; actors act with local copies of the policy or "
                    "through the learner's batched inference. See docs/rl.md. " + needs("rl"),
        formatter_class=HelpFormatter)
    p.set_defaults(extra="rl")
    sub = p.add_subparsers(dest="rl_command", metavar="COMMAND", required=True)

    train = sub.add_parser("train", help="a learner plus N actor processes on a gymnasium environment",
                           formatter_class=HelpFormatter)
    _learner_options(train)
    train.add_argument("--actors", type=int, default=2, help="actor processes to start")
    train.add_argument("--mode", default="local", choices=("local", "central"),
                       help="how actors get actions: local copies of the policy or central inference")
    train.add_argument("--num-envs", type=int, default=8, help="environments per actor")
    train.add_argument("--actor-nice", type=int, default=None,
                       help="how much lower the actors' CPU priority is than the learner's, 0-19 (default "
                            "10: on shared cores the learner's update, which every actor waits for, comes first)")
    train.set_defaults(func=run_train)

    serve = sub.add_parser("serve", help="a learner waiting for actors (prints its URL)",
                           formatter_class=HelpFormatter)
    _learner_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8100, help="TCP port (0 = any free port)")
    serve.add_argument("--idle-timeout", type=float, default=None,
                       help="stop when no segment arrived for this many seconds (default: wait for ever)")
    serve.set_defaults(func=run_serve)

    act = sub.add_parser("act", help="one actor connecting to a learner by URL", formatter_class=HelpFormatter)
    act.add_argument("url", metavar="URL", help="the learner, e.g. http://127.0.0.1:8100")
    act.add_argument("--env", default=None, help="gymnasium environment id (default: the learner's)")
    act.add_argument("--mode", default="local", choices=("local", "central"),
                     help="local copy of the policy, or central inference on the learner")
    act.add_argument("--num-envs", type=int, default=8, help="environments stepped together")
    act.add_argument("--pull-every", type=int, default=1, help="local mode: pull new weights every N segments")
    act.add_argument("--seed", type=int, default=0, help="environment and sampling seed")
    act.add_argument("--name", default=None, help="actor name the learner sees (default: actor-PID)")
    act.add_argument("--max-frames", type=int, default=None, help="stop after this many frames")
    act.add_argument("--reconnect-timeout", type=float, default=60.0,
                     help="seconds to keep retrying an unreachable learner (a restart) before failing")
    act.add_argument("--token", default=os.environ.get("PARTRAIN_RL_TOKEN"),
                     help="bearer token of the learner (default: $PARTRAIN_RL_TOKEN)")
    act.set_defaults(func=run_act)


def _learner_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env", default="CartPole-v1", help="gymnasium environment id (discrete actions)")
    p.add_argument("--out", default=None, help=f"directory for metrics, curves and the checkpoint (default: "
                   f"{DEFAULT_OUT}, or {DEFAULT_OUT}-2, -3, ... when that holds a run)")
    p.add_argument("--max-frames", type=int, default=500_000, help="stop after this many environment frames")
    p.add_argument("--target", type=float, default=None,
                   help="stop once the mean return of the last 20 episodes reaches this (CartPole-v1: 475)")
    p.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--algorithm", choices=("vtrace", "ppo"), default="vtrace",
                   help="learner update: V-trace actor-critic (one step per batch, the default) or PPO "
                        "(10 clipped epochs per batch: fewer frames, more learner time)")
    p.add_argument("--epochs", type=int, default=None,
                   help="gradient steps per batch (default: vtrace 1, ppo 10)")
    p.add_argument("--min-epochs", type=int, default=None,
                   help="ppo: run fewer passes, not under this many, once the next batch is waiting "
                        "(passes overlap collection; default: always --epochs)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--unroll", type=int, default=16, help="steps per segment")
    p.add_argument("--batch-segments", type=int, default=None,
                   help="segments per update (= per version; default: one per actor acting, at least 2, "
                        "which keeps the policy lag at about 1 version)")
    p.add_argument("--max-queue", type=int, default=8,
                   help="segments that may wait; beyond, actors are told to retry later (503)")
    p.add_argument("--max-lag", type=int, default=10,
                   help="versions a segment's weights may lag before the actor is told to pull (409)")
    p.add_argument("--hidden", type=int, default=64, help="hidden units of the policy and value MLPs")
    p.add_argument("--device", default="cpu",
                   help="where the learner trains and runs central inference: cpu (default), cuda, cuda:N or auto; "
                        "actors act on their own CPUs")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and of central sampling")
    p.add_argument("--checkpoint-every", type=int, default=100, help="versions between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--report-every", type=float, default=2.0, help="seconds between progress lines")
    p.add_argument("--json", default=None, metavar="FILE", help="write the run's summary as JSON")
    p.add_argument("--token", default=os.environ.get("PARTRAIN_RL_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (default: $PARTRAIN_RL_TOKEN)")


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value <= 0:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"Expected {flag} > 0. Received: {flag} {value}")


def _config(args: argparse.Namespace) -> Any:
    from .run import PPO_EPOCHS, LearnerConfig

    _positive(args, "max_frames", "lr", "epochs", "min_epochs", "unroll", "batch_segments", "max_queue", "max_lag", "hidden",
              "checkpoint_every", "report_every", "timeout")
    check_device(args.device)  # a name torch refuses, or cuda where there is none: one line
    args.out = run_dir(args.out, DEFAULT_OUT, resume=args.resume, command="rl")
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    if args.resume and not os.path.exists(checkpoint):
        raise UsageError(f"Expected a checkpoint to resume from. Received: {checkpoint!r} (no such file)")
    if args.min_epochs is not None and args.algorithm != "ppo":
        raise UsageError(f"Expected --min-epochs with --algorithm ppo. Received: --algorithm {args.algorithm}")
    if args.min_epochs is not None and args.min_epochs > (args.epochs or PPO_EPOCHS):
        raise UsageError(f"Expected --min-epochs <= --epochs ({args.epochs or PPO_EPOCHS}). Received: --min-epochs "
                         f"{args.min_epochs}")
    return LearnerConfig(env=args.env, hidden=args.hidden, lr=args.lr, unroll=args.unroll, algorithm=args.algorithm,
                         epochs=args.epochs, min_epochs=args.min_epochs,
                         batch_segments=args.batch_segments, max_queue=args.max_queue, max_lag=args.max_lag,
                         seed=args.seed, checkpoint=checkpoint, checkpoint_every=args.checkpoint_every,
                         resume=args.resume, device=args.device)


def _train(args: argparse.Namespace, learner: Any, server: Any, prog: str, idle_timeout: float | None) -> int:
    from ..metrics import MetricsWriter
    from .run import curve_rows, format_row, summary

    writer = MetricsWriter(args.out, resume=args.resume)
    batcher = server.app.state.batchers["policy"]
    written = [time.monotonic()]

    def on_report(row: dict[str, Any]) -> None:
        print(f"{prog}: {format_row(row, batcher.stats.batch_sizes)}", flush=True)
        if time.monotonic() - written[0] > 30.0:  # drawing the curves takes ~0.5 s of the training thread
            writer.write(curve_rows(learner.history))
            written[0] = time.monotonic()

    try:
        learner.train(max_frames=args.max_frames, target=args.target, timeout=args.timeout,
                      idle_timeout=idle_timeout, on_report=on_report, report_every=args.report_every)
    finally:
        if learner.history:
            writer.write(curve_rows(learner.history))
        writer.close()
        if learner.stats.segments:
            learner.save(os.path.join(args.out, "checkpoint.pt"))
    if learner.stats.segments == 0:  # nothing trained is a failed run, never status 0
        print(f"{prog}: error: Expected segments from actors. Received: none"
              + (f" for {idle_timeout:g} s" if learner.stats.idle else ""), file=sys.stderr)
        return 1
    result = summary(learner)
    result["batch_sizes"] = {str(k): v for k, v in sorted(batcher.stats.batch_sizes.items())}
    solved = result["solved_seconds"]
    print(f"{prog}: {result['versions']} versions, {result['frames']} frames in {result['seconds']:.1f} s "
          f"({result['fps']:.0f} frames/s), mean return {result['mean_return']:.1f}"
          + (f", reached {args.target:g} after {result['solved_frames']} frames in {solved:.1f} s"
             if solved is not None else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from .run import build_learner, serving

    _positive(args, "idle_timeout")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"Expected --port in 0..65535. Received: {args.port}")
    learner = build_learner(_config(args))
    with serving(learner, host=args.host, port=args.port, token=args.token) as server:
        print(f"partrain rl serve: learner for {args.env} on {learner.device} at {server.url} (version "
              f"{learner.version})",
              flush=True)
        return _train(args, learner, server, "partrain rl serve", args.idle_timeout)


def run_train(args: argparse.Namespace) -> int:
    from .run import ACTOR_NICE, build_learner, serving, start_actor, stop_actors

    _positive(args, "actors", "num_envs")
    nice = ACTOR_NICE if args.actor_nice is None else args.actor_nice
    if not 0 <= nice <= 19:
        raise UsageError(f"Expected --actor-nice in 0..19. Received: {nice}")
    learner = build_learner(_config(args))
    procs = []
    code = 1
    try:
        with serving(learner, token=args.token) as server:
            print(f"partrain rl train: learner for {args.env} on {learner.device} at {server.url}; starting {args.actors} "
                  f"{args.mode}-inference actors", flush=True)
            for i in range(args.actors):
                procs.append(start_actor(server.url, args.env, num_envs=args.num_envs, mode=args.mode,
                                         seed=args.seed * 1000 + i + 1, token=args.token, name=f"actor-{i}",
                                         nice=nice))
            code = _train(args, learner, server, "partrain rl train", idle_timeout=60.0)
    finally:
        codes = stop_actors(procs)
    failed = [i for i, c in enumerate(codes) if c not in (0, None)]
    if failed:
        print(f"partrain rl train: note: actors {failed} ended with status "
              f"{[codes[i] for i in failed]}", file=sys.stderr)
    return code


def run_act(args: argparse.Namespace) -> int:
    from .client import run_actor

    _positive(args, "num_envs", "pull_every", "max_frames", "reconnect_timeout")
    name = args.name or f"actor-{os.getpid()}"
    # the actor's own lines (an outage of the learner, and its end) on stderr, as the CLI's
    logging.basicConfig(level=logging.INFO, format="partrain rl act: %(message)s", stream=sys.stderr)
    try:
        stats = run_actor(args.url, args.env, num_envs=args.num_envs, mode=args.mode,
                          pull_every=args.pull_every, token=args.token, seed=args.seed,
                          max_frames=args.max_frames, name=name, reconnect_timeout=args.reconnect_timeout)
    except ConnectionError as exc:  # no learner (or it stayed away longer than --reconnect-timeout)
        print(f"partrain rl act: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        if "HTTP 4" not in str(exc):  # a 4xx is bad input (token, environment): one line, status 2
            raise
        raise UsageError(str(exc)) from None
    print(f"partrain rl act: {name}: {stats.frames} frames, {stats.segments} segments, {stats.episodes} "
          f"episodes, {stats.pulls} weight pulls ({stats.unchanged} unchanged), {stats.dropped} stale"
          + (f", infer p50 {1000 * statistics.median(stats.infer_seconds):.3f} ms" if stats.infer_seconds else ""),
          flush=True)
    return 0
