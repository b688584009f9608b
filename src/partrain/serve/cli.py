"""``partrain serve MODEL...``: serve models over the Open Inference Protocol v2 (HTTP)."""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from typing import Any

from ..batching import make_policy
from ..cli import HelpFormatter
from ..env import check_device
from ..errors import UsageError
from ..extras import needs
from .body import DEFAULT_MAX_BODY_BYTES
from .loading import load_models, model_names, parse_dtypes, parse_shapes
from .protocol import DATATYPES, ServedModel
from .replicas import default_threads, run_server
from .stages import MIN_PIECE_ROWS, stage_processes


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve models over HTTP (Open Inference Protocol v2) with dynamic batching",
        description=(
            "Serve one or more models over the Open Inference Protocol v2 REST API (KServe/Triton) "
            "with dynamic batching. MODEL is [name=]PATH where PATH is a checkpoint written by "
            "'partrain train', a TorchScript file or a torch.export .pt2 file, a directory holding a Hugging Face "
            "causal language model (save_pretrained), or module:factory. A causal language model (the built-in "
            "GPT, a Hugging Face one) also answers /generate and /generate_stream with continuous batching. "
            "See docs/serve-api.md. " + needs("serve")
        ), formatter_class=HelpFormatter)
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="[name=]checkpoint|torchscript|.pt2|hf-model-dir|module:factory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0 = any free port; default 8000)")
    p.add_argument("--max-batch-size", type=int, default=64, help="most rows per model call (default 64)")
    p.add_argument("--policy", default="adaptive",
                   help="batching window: adaptive (default), fixed:MS (wait up to MS milliseconds), none")
    p.add_argument("--max-queue", type=int, default=4096,
                   help="requests that may wait per model before answering 503 (default 4096)")
    p.add_argument("--max-running", type=int, default=32,
                   help="generative models: sequences decoded together, each holding a KV cache slot (default 32; "
                        "fewer when --kv-cache-mb holds fewer)")
    p.add_argument("--kv-cache-mb", type=int, default=1024,
                   help="generative models: KV cache budget per model and replica, in MiB (default 1024)")
    p.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="generative models: prompt tokens prefilled per step, so that long prompts do not stall "
                        "running sequences (default 2048)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body accepted, else 413 (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--replicas", type=int, default=1,
                   help="processes serving on the same port, each with its own model copy (default 1; "
                        "with --device cuda: one per GPU)")
    p.add_argument("--stages", type=int, default=1,
                   help="split the model (an nn.Sequential) over this many processes, balanced by parameters: "
                        "for a model too big for one (default 1: not split). See docs/strategies/pipeline.md")
    p.add_argument("--microbatches", type=int, default=4,
                   help="with --stages: pieces each batch goes through the stages in, so that they overlap "
                        "(default 4)")
    p.add_argument("--min-microbatch-rows", type=int, default=MIN_PIECE_ROWS,
                   help="with --stages: the fewest rows of a piece; a smaller batch goes in fewer pieces (a piece "
                        "of few rows reads its stage's weights for little arithmetic, so more pieces cost more than "
                        f"they overlap; default {MIN_PIECE_ROWS})")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per replica (default: cores // replicas)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda (a replica per visible GPU) or cuda:N "
                   "(that GPU)")
    p.add_argument("--token", default=os.environ.get("PARTRAIN_SERVE_TOKEN"),
                   help="require 'Authorization: Bearer TOKEN' (default: $PARTRAIN_SERVE_TOKEN; health "
                        "endpoints stay open)")
    p.add_argument("--input-shape", default=None,
                   help="one sample's shape without the batch dim, e.g. 1,28,28 (-1: a dynamic dim), for models "
                        "that do not record it and whose first layer does not determine it (Linear, Conv, "
                        "Embedding do); several inputs: one shape each, separated by ';' (() for one number per "
                        "sample), e.g. '-1,8;()'")
    p.add_argument("--input-dtype", default=None,
                   help=f"input datatype for models that do not record it, one of {', '.join(sorted(DATATYPES))} "
                        "(default: the first layer's, INT64 for Embedding, else FP32); several inputs: one each, "
                        "comma-separated, e.g. FP32,INT64")
    p.set_defaults(func=run, extra="serve")


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"Expected {name} >= 1. Received: {name}={value}")


def run(args: argparse.Namespace) -> int:
    _positive("--max-batch-size", args.max_batch_size)
    _positive("--max-queue", args.max_queue)
    _positive("--max-body-bytes", args.max_body_bytes)
    _positive("--replicas", args.replicas)
    _positive("--threads", args.threads)
    _positive("--stages", args.stages)
    _positive("--microbatches", args.microbatches)
    _positive("--min-microbatch-rows", args.min_microbatch_rows)
    _positive("--max-running", args.max_running)
    _positive("--kv-cache-mb", args.kv_cache_mb)
    _positive("--max-prefill-tokens", args.max_prefill_tokens)
    if args.stages > 1 and (args.replicas > 1 or args.device != "cpu" or len(args.models) != 1):
        raise UsageError(f"Expected --stages with one MODEL, one replica and --device cpu. Received: "
                         f"{len(args.models)} model(s), --replicas {args.replicas}, --device {args.device}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"Expected --port in 0..65535. Received: {args.port}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UsageError(f"Expected --device cpu, cuda or cuda:N. Received: {args.device!r}")
    check_device(args.device)  # cuda where there is none, or cuda:N past the last GPU: one line
    try:
        make_policy(args.policy)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    parse_shapes(args.input_shape)
    parse_dtypes(args.input_dtype)
    make_models = functools.partial(
        load_models, list(args.models), input_shape=args.input_shape, input_dtype=args.input_dtype,
        max_batch_size=args.max_batch_size, policy=args.policy, max_queue=args.max_queue,
        generation={"max_running": args.max_running, "cache_bytes": args.kv_cache_mb << 20,
                    "max_prefill_tokens": args.max_prefill_tokens},
    )
    noted = _NoteGenerative(make_models)
    if args.replicas > 1 or args.device != "cpu":
        # fail fast in the parent on a bad MODEL instead of once per replica
        for model in noted():
            del model

    names = model_names(args.models)

    def announce(url: str) -> None:
        # one line per model, its inference URL in full (GET {url}/v2/models lists them too)
        for name in names:
            also = (f" and {url}/v2/models/{name}/generate (also generate_stream)"
                    if name in noted.generative else "")
            print(f"partrain serve: serving model {name!r} at {url}/v2/models/{name}/infer{also}", flush=True)

    server = functools.partial(
        run_server, host=args.host, port=args.port, replicas=args.replicas, device=args.device,
        threads=args.threads or (default_threads(args.stages) if args.stages > 1 else None),
        app_options={"token": args.token, "max_body_bytes": args.max_body_bytes},
        announce=announce,
    )
    if args.stages == 1:
        # one process builds its models itself: noted on the way; replicas got noted above
        return server(noted if args.replicas == 1 and args.device == "cpu" else make_models)
    threads = args.threads or default_threads(args.stages)
    with stage_processes(args.models[0], args.stages, microbatches=args.microbatches, threads=threads,
                         min_rows=args.min_microbatch_rows) as first:
        return server(functools.partial(make_models, transform=first))


class _NoteGenerative:
    """``make_models`` that notes which models generate (for the start line) as it builds them."""

    def __init__(self, make_models: Callable[..., list[ServedModel]]) -> None:
        self.make_models = make_models
        self.generative: set[str] = set()

    def __call__(self, **kwargs: Any) -> list[ServedModel]:
        models = self.make_models(**kwargs)
        self.generative.update(m.name for m in models if m.generator is not None)
        return models
