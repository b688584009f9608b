"""``partrain stream MODEL``: train a model online on an MQTT topic (or JSON lines), answering predictions.

MODEL follows ``partrain serve``: a checkpoint written by ``partrain train`` (or
by ``partrain stream``: ``OUT/checkpoint.pt``), or ``module:factory``. Output
follows ``partrain train``: ``OUT/metrics.csv`` (a row per ``--metrics-interval``),
``OUT/curves.png`` and ``OUT/checkpoint.pt`` (every ``--checkpoint-every`` updates
and at the end; ``--resume`` continues from it exactly; ``partrain serve`` serves it).

SIGINT/SIGTERM drain: the source stops taking messages (the broker keeps the
rest), every accepted item is trained on and answered, the final checkpoint and
curves are written, and the run ends with one summary line and status 130/143.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import threading
from typing import Any

import torch

from ..cli import HelpFormatter
from ..env import check_device, pick_device
from ..errors import UsageError
from ..files import check_output_file, run_dir
from .options import LOSSES, OVERFLOW, SCHEDULES

DEFAULT_OUT = "runs/stream"
DTYPES = {"FP32": torch.float32, "FP64": torch.float64, "FP16": torch.float16, "BF16": torch.bfloat16,
          "INT64": torch.int64, "INT32": torch.int32}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "stream",
        help="train a model online on a live stream (MQTT), predicting on each item",
        description=(
            "Train MODEL online: each batch is every item that arrived while the previous step ran; each "
            "item gets the model's prediction (from the weights before the batch's update) and labelled "
            "items train the model. MODEL is a checkpoint (partrain train / partrain stream) or "
            "module:factory. See docs/streaming.md. MQTT and --metrics-port need the 'stream' extra: "
            "pip install 'partrain[stream]'."
        ), formatter_class=HelpFormatter)
    p.add_argument("model", metavar="MODEL", help="checkpoint path or module:factory")
    src = p.add_argument_group("source")
    src.add_argument("--mqtt", metavar="HOST:PORT", default=None, help="MQTT broker to subscribe to")
    src.add_argument("--topic", action="append", default=None, metavar="FILTER",
                     help="topic filter to subscribe to, repeatable (e.g. sensors/#)")
    src.add_argument("--reply-topic", default=None, metavar="TOPIC",
                     help="publish predictions here ({topic}: the item's topic); with --mqtt-protocol 5 a "
                          "message's response topic wins")
    src.add_argument("--qos", type=int, default=1, choices=(1, 2), help="subscription and reply QoS")
    src.add_argument("--mqtt-protocol", default="3.1.1", choices=("3.1.1", "5"),
                     help="3.1.1 (paho's default, the faster to read: replies go to --reply-topic); 5: a message's "
                          "response topic and correlation data are answered")
    src.add_argument("--client-id", default="partrain-stream",
                     help="MQTT client id: the broker keeps this session's messages across disconnects")
    src.add_argument("--connect-timeout", type=float, default=10.0,
                     help="seconds to wait for the broker at start (then: reconnect forever)")
    src.add_argument("--input", default=None, metavar="FILE",
                     help="instead of MQTT: JSON lines, one item per line ('-': standard input); each item's "
                          "answer is one JSON line on --output")
    src.add_argument("--output", default="-", metavar="FILE",
                     help="with --input: where the answers go, one JSON line per item in the order read "
                          "({\"id\", \"version\", \"prediction\"} or {\"id\", \"error\"}; default '-': standard output)")
    src.add_argument("--input-shape", default=None, help="one item's x shape, e.g. 16,8 (raw payloads need it)")
    src.add_argument("--input-dtype", default="FP32", choices=sorted(DTYPES), help="x's datatype")

    tr = p.add_argument_group("training")
    tr.add_argument("--loss", default="mse", choices=sorted(LOSSES))
    tr.add_argument("--optimizer", default="sgd", choices=("sgd", "adam", "adamw"))
    tr.add_argument("--lr", type=float, default=0.01)
    tr.add_argument("--momentum", type=float, default=0.0, help="for sgd")
    tr.add_argument("--weight-decay", type=float, default=0.0)
    tr.add_argument("--lr-schedule", default="constant", help=f"by items trained on: {', '.join(SCHEDULES)}")
    tr.add_argument("--replay", type=int, default=0, help="items of recent history mixed into each update (at most as many as it holds yet)")
    tr.add_argument("--replay-capacity", type=int, default=10000, help="labelled items the replay buffer keeps")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    tr.add_argument("--device", default="auto",
                    help="where the model trains: cpu, cuda, cuda:N or auto (CUDA when present); items arrive "
                         "on the CPU, each batch is copied there, predictions come back in one copy a batch")

    b = p.add_argument_group("batching and load")
    b.add_argument("--max-batch", type=int, default=256, help="most items per step")
    b.add_argument("--min-batch", type=int, default=1, help="items to wait for before a step (with --max-wait-ms)")
    b.add_argument("--max-wait-ms", type=float, default=0.0,
                   help="longest an item waits for --min-batch (default 0: never wait)")
    b.add_argument("--max-queue", type=int, default=10000, help="items that may wait for a step")
    b.add_argument("--overflow", default="block", choices=OVERFLOW,
                   help="when --max-queue items wait: block the source, drop the oldest, or reject")

    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help=f"directory for metrics.csv, curves.png, checkpoint.pt (default: "
                   f"{DEFAULT_OUT}, or {DEFAULT_OUT}-2, -3, ... when that holds a run)")
    o.add_argument("--checkpoint-every", type=int, default=100, metavar="UPDATES", help="0: only at the end")
    o.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt exactly")
    o.add_argument("--metrics-interval", type=float, default=1.0, help="seconds per metrics.csv row")
    o.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port of 127.0.0.1 (0: any free port)")
    o.add_argument("--max-items", type=int, default=None, help="stop after accepting this many items")
    o.add_argument("--quiet", action="store_true", help="no log lines, only the summary")
    p.set_defaults(func=run)


def _positive(name: str, value: float | None, least: float = 1) -> None:
    if value is not None and not value >= least:
        raise UsageError(f"Expected {name} >= {least:g}. Received: {name}={value}")


def check_args(args: argparse.Namespace) -> None:
    """Every option checked before anything starts (one line each)."""
    if (args.mqtt is None) == (args.input is None):
        raise UsageError("Expected exactly one source: --mqtt HOST:PORT or --input FILE. Received: "
                         + ("both" if args.mqtt else "neither"))
    if args.mqtt is not None and not args.topic:
        raise UsageError("Expected --topic FILTER with --mqtt. Received: no --topic")
    if args.input not in (None, "-") and not os.path.isfile(args.input):
        raise UsageError(f"Expected --input to be a file of JSON lines or '-'. Received: {args.input!r} (no such file)")
    if args.output != "-" and args.input is None:
        raise UsageError(f"Expected --output with --input (MQTT answers on --reply-topic). Received: --output "
                         f"{args.output!r} with --mqtt")
    if args.output != "-":
        check_output_file(args.output, "--output")
    for name in ("max_batch", "min_batch", "max_queue", "replay_capacity", "threads", "max_items"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    _positive("--replay", args.replay, 0)
    _positive("--checkpoint-every", args.checkpoint_every, 0)
    _positive("--max-wait-ms", args.max_wait_ms, 0)
    if not args.connect_timeout > 0:
        raise UsageError(f"Expected --connect-timeout > 0 seconds. Received: {args.connect_timeout}")
    if not args.metrics_interval > 0:
        raise UsageError(f"Expected --metrics-interval > 0 seconds. Received: {args.metrics_interval}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"Expected --metrics-port in 0..65535. Received: {args.metrics_port}")
    check_device(args.device)  # a name torch refuses, or cuda where there is none: one line
    args.out = run_dir(args.out, DEFAULT_OUT, resume=args.resume, command="stream", quiet=args.quiet)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"Expected --out to be a directory. Received: {args.out!r}, a file")


def load_model(spec: str) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, Any] | None]:
    """MODEL as ``(model to train, the part a checkpoint saves, its model_spec)``."""
    from ..serve.checkpoints import Preprocess
    from ..serve.loading import module_from_source

    model, model_spec = module_from_source(spec)
    inner = model.model if isinstance(model, Preprocess) else model
    return model, inner, model_spec


def run(args: argparse.Namespace) -> int:
    from .._process import tune_allocator
    from ..optim import make_optimizer
    from ..serve.loading import parse_shape
    from .codec import Codec
    from .options import parse_lr_schedule
    from .trainer import SWITCH_INTERVAL, OnlineTrainer

    check_args(args)
    shape = parse_shape(args.input_shape)
    if shape is not None and -1 in shape:
        raise UsageError(f"Expected --input-shape without dynamic (-1) dims. Received: {args.input_shape!r}")
    parse_lr_schedule(args.lr_schedule)
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "checkpoint.pt")
    check_output_file(ckpt, "--out")
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="partrain stream: %(message)s", stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    # as in every process partrain starts: freed activations stay in the heap, so a step does not
    # page-fault its memory in afresh (a step of a few ms paid up to several ms for it)
    tune_allocator()
    # producers (MQTT's network thread, callbacks) run Python flat out at saturation and give the GIL
    # up only every switch interval: at the default 5 ms a step waited that long at each of its few
    # returns from torch (bench stream: 0.84x a hand-written loop's items/s; 0.96x at 1 ms)
    sys.setswitchinterval(SWITCH_INTERVAL)
    torch.manual_seed(args.seed)
    model, inner, spec = load_model(args.model)
    device = pick_device(0, args.device)
    model.to(device)  # before the optimizer: its state follows the parameters
    optimizer = make_optimizer(args.optimizer, model.parameters(), lr=args.lr, momentum=args.momentum,
                               weight_decay=args.weight_decay)
    codec = Codec(shape, DTYPES[args.input_dtype])
    trainer = OnlineTrainer(
        model, optimizer, args.loss, max_batch=args.max_batch, min_batch=args.min_batch,
        max_wait=args.max_wait_ms / 1000.0, max_queue=args.max_queue, overflow=args.overflow,
        replay=args.replay, replay_capacity=args.replay_capacity, seed=args.seed, lr_schedule=args.lr_schedule,
        checkpoint=ckpt, checkpoint_every=args.checkpoint_every, resume=args.resume, model_spec=spec,
        checkpoint_module=inner, input_shape=shape,
        metrics_csv=os.path.join(args.out, "metrics.csv"), metrics_interval=args.metrics_interval,
        on_step=_freeze_after_first_update())
    # torch, the model and the optimizer are here to stay: move their objects out of the cyclic
    # collector's way. Its full collections scan every object while holding the GIL; with
    # thousands of items per second they come every few seconds and stall steps and sources.
    gc.collect()
    gc.freeze()
    done = threading.Event()  # the source ended (--input read whole) or --max-items were accepted
    source: Any = None
    try:
        if args.metrics_port is not None:
            print(f"partrain stream: metrics at {trainer.serve_metrics('127.0.0.1', args.metrics_port)}",
                  flush=True)
        source = _start_source(args, trainer, codec, done)
        # the main thread only waits: SIGTERM arrives here as Interrupted, never inside a submit
        while not done.wait(0.5):
            pass
    finally:
        if source is not None:
            source.pause()
        try:
            stats = trainer.close(drain=True, curves=os.path.join(args.out, "curves.png"))
        finally:
            unsent = source.stop() if source is not None else 0
            gc.unfreeze()  # main() may run inside another program (a test)
        if source is not None:  # a source that never started has nothing to report
            print(_summary(stats, trainer, ckpt, unsent), file=sys.stderr, flush=True)
    if stats.updates == 0:
        raise UsageError(f"Expected labelled items to train on. Received: {stats.accepted} items accepted, "
                         f"{stats.failed} failed, no update taken (no labels, or every loss non-finite)")
    if stats.skipped_updates or stats.failed or stats.failed_updates:
        # a run that skipped updates (non-finite loss) or failed steps is not a clean run: say so in the status
        print(f"partrain stream: error: {stats.skipped_updates} updates skipped (non-finite loss), "
              f"{stats.failed_updates} updates failed after their predictions, "
              f"{stats.failed} items failed (their step raised)", file=sys.stderr)
        return 1
    return 0


def _freeze_after_first_update() -> Any:
    """An ``on_step`` hook: freeze once more after the first update (the optimizer's first step
    imports parts of torch lazily: thousands of objects that would stay in the collector's way)."""
    done: list[bool] = []

    def hook(record: Any) -> None:
        if record.updated and not done:
            done.append(True)
            gc.freeze()

    return hook


def _summary(stats: Any, trainer: Any, ckpt: str, unsent: int) -> str:
    line = (f"partrain stream: {stats.accepted} items accepted: {stats.predicted} answered ({stats.trained} "
            f"trained on in {stats.updates} updates), {stats.dropped} dropped, {stats.failed} failed, "
            f"{stats.abandoned} abandoned; {stats.malformed} malformed, {stats.duplicates} duplicates, "
            f"{stats.rejected} rejected; model version {trainer.version} on {trainer.device}, checkpoint {ckpt}")
    if unsent:
        line += f"; {unsent} replies not sent (broker unreachable)"
    return line


class _LinesSource:
    """``--input``: JSON lines (a file or standard input) read on a thread, one item per line; each
    accepted item's answer is written to ``output`` as one JSON line when its step is done (the
    trainer finishes items in the order they were submitted, so answers keep the input's order)."""

    def __init__(self, path: str, trainer: Any, codec: Any, done: threading.Event, max_items: int | None,
                 output: str = "-"):
        self.path, self.trainer, self.codec, self.done, self.max_items = path, trainer, codec, done, max_items
        self.out = sys.stdout.buffer if output == "-" else open(output, "wb")  # noqa: SIM115
        self._out_lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._read, name="partrain-stream-input", daemon=True)
        self.thread.start()

    def _answer(self, future: Any, item_id: Any) -> None:
        """Done callback (the trainer's thread): the item's answer as one line."""
        from .codec import encode_outcome

        line = encode_outcome(future, item_id) + b"\n"
        with self._out_lock:
            self.out.write(line)
            if self.out is sys.stdout.buffer:
                self.out.flush()  # a reader of the pipe sees each answer as it comes

    def _read(self) -> None:
        from .codec import MalformedPayload
        from .trainer import DuplicateItem, TrainerClosed

        log = logging.getLogger("partrain.stream")
        stream = sys.stdin.buffer if self.path == "-" else open(self.path, "rb")  # noqa: SIM115
        try:
            for number, line in enumerate(stream, 1):
                if self._stop.is_set():
                    break
                if not line.strip():
                    continue
                try:
                    item = self.codec.decode_json(line)
                    future = self.trainer.submit(item.x, item.y, weight=item.weight, id=item.item_id)
                    future.add_done_callback(lambda f, item_id=item.item_id: self._answer(f, item_id))
                except (MalformedPayload, UsageError) as exc:
                    self.trainer.count_malformed()
                    log.warning("malformed line %d skipped: %s", number, exc)
                except DuplicateItem:
                    continue
                except TrainerClosed:
                    break
                if self.max_items and self.trainer.stats.accepted >= self.max_items:
                    break
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()
            self.done.set()

    def pause(self) -> None:
        self._stop.set()

    def stop(self) -> int:
        """After the trainer closed (every accepted item answered): the answers flushed."""
        with self._out_lock:
            self.out.flush()
            if self.out is not sys.stdout.buffer:
                self.out.close()
        return 0


def _start_source(args: argparse.Namespace, trainer: Any, codec: Any, done: threading.Event) -> Any:
    if args.input is not None:
        return _LinesSource(args.input, trainer, codec, done, args.max_items, args.output)
    from .mqtt import MqttConfig, MqttSource, parse_address, topics_of

    host, port = parse_address(args.mqtt)
    config = MqttConfig(host, port, topics_of(args.topic), qos=args.qos, reply_topic=args.reply_topic,
                        client_id=args.client_id, protocol=args.mqtt_protocol)
    source = MqttSource(trainer, config, codec).start(timeout=args.connect_timeout)
    print(f"partrain stream: training on mqtt://{host}:{port} topics {', '.join(config.topics)}", flush=True)
    if args.max_items:
        def watch() -> None:
            while not done.is_set():
                if trainer.stats.accepted >= args.max_items:
                    done.set()
                done.wait(0.05)  # polling a counter, bounded by the run
        threading.Thread(target=watch, name="partrain-stream-max-items", daemon=True).start()
    return source
