"""The learner's HTTP face: the OIP app for central inference plus four ``/rl/v1`` routes.

Central inference is `partrain.serve.create_app` serving one model, ``policy``, whose
function is `Learner.act` (so the project's `Batcher` batches every actor's
observations and the freshest weights act). Any Open Inference Protocol client can
call ``POST /v2/models/policy/infer`` with input ``obs`` (FP32, ``[N, *obs_shape]``)
and read outputs ``action`` (INT64), ``logp`` (FP32, log-probability of that action),
``logits``, ``value`` and ``version`` (INT64: the weights version that answered).

Routes added here (same bearer token as the OIP routes):

==========================  =====  ====================================================
``/rl/v1/info``             GET    env, obs shape, actions, unroll, model spec, version
``/rl/v1/weights``          GET    safetensors; ``ETag: "V"``; ``If-None-Match: "V"`` -> 304
``/rl/v1/segments``         POST   a safetensors segment -> ``{"version": V}``; with
                                   ``?weights_since=V`` the weights instead (as ``GET
                                   /rl/v1/weights``) when newer than V; 400 bad segment
                                   or parameter, 409 weights too stale (pull, then go
                                   on), 503 + ``Retry-After`` queue full, 410 training
                                   ended
``/rl/v1/stats``            GET    the learner's figures and the inference batch sizes
==========================  =====  ====================================================
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..serve.app import bearer_ok, create_app, error_response, guard, json_response
from ..serve.body import body_decoder
from ..serve.protocol import ServedModel, TensorSpec
from ..serve.replicas import bind_socket, serve_app, url_of
from .learner import ExperienceFull, Learner, StaleWeights, TrainingDone
from .wire import CONTENT_TYPE, VERSION_HEADER, decode_segment

POLICY = "policy"  # the OIP model name of central inference
MAX_SEGMENT_BYTES = 256 * 1024 * 1024
QUEUE_WAIT = 1.0  # seconds a segment may wait for room in a full experience queue


def policy_model(learner: Learner, max_batch_size: int = 256, max_queue: int = 4096) -> ServedModel:
    """The `ServedModel` whose batches run `Learner.act`."""
    n = learner.num_actions

    def fn(obs: Any) -> tuple:
        return learner.act(obs)

    return ServedModel(
        name=POLICY, fn=fn, max_batch_size=max_batch_size, max_queue=max_queue,
        inputs=[TensorSpec("obs", "FP32", (-1, *learner.obs_shape))],
        outputs=[TensorSpec("action", "INT64", (-1,)), TensorSpec("logp", "FP32", (-1,)),
                 TensorSpec("logits", "FP32", (-1, n)), TensorSpec("value", "FP32", (-1,)),
                 TensorSpec("version", "INT64", (-1,))],
        parameters={"task": "rl-policy"},
    )


def create_learner_app(learner: Learner, *, token: str | None = None, max_batch_size: int = 256) -> Any:
    """The Starlette app of ``learner``: OIP central inference and the ``/rl/v1`` routes."""
    app = create_app([policy_model(learner, max_batch_size)], token=token, server_name="partrain-rl")
    secret = token.encode() if token else None

    def authorized(request: Request) -> bool:
        return bearer_ok(request, secret)

    def guarded(handler: Any) -> Any:
        return guard(authorized, handler)

    async def info(request: Request) -> Response:
        return json_response({
            "version": learner.version, "env": learner.env, "obs_shape": list(learner.obs_shape),
            "num_actions": learner.num_actions, "unroll": learner.unroll, "max_lag": learner.max_lag,
            "model": learner.model_spec, "finished": learner.finished, "policy_model": POLICY,
        })

    async def weights_response() -> Response:
        # serialised by the training thread when it published (actors pull every version), else here
        cached = learner.cached_weights()
        version, blob = cached if cached is not None else await asyncio.to_thread(learner.weights)
        return Response(blob, media_type=CONTENT_TYPE,
                        headers={"ETag": f'"{version}"', VERSION_HEADER: str(version)})

    async def weights(request: Request) -> Response:
        asked = request.headers.get("if-none-match", "").strip()
        version = learner.version
        if asked == f'"{version}"':  # unchanged: no body, nothing serialised
            return Response(status_code=304, headers={"ETag": f'"{version}"', VERSION_HEADER: str(version)})
        return await weights_response()

    async def segments(request: Request) -> Response:
        since = request.query_params.get("weights_since")
        try:
            since_version = None if since is None else int(since)
        except ValueError:
            return error_response(400, f"Expected weights_since as a version number (an integer). "
                                       f"Received: {since[:40]!r}")
        decoder = body_decoder(request.headers.get("content-encoding"), MAX_SEGMENT_BYTES)
        async for chunk in request.stream():
            decoder.feed(chunk)
        segment = decode_segment(decoder.finish(), learner.obs_shape, learner.num_actions)
        try:
            # room now (the common case): queued here, on the event loop, without a thread hop
            version = learner.offer_nowait(segment)
            if version is None:
                # back-pressure: hold the actor up to QUEUE_WAIT s for room (off the loop) before "retry later"
                version = await asyncio.to_thread(learner.offer, segment, QUEUE_WAIT)
        except TrainingDone as exc:
            return error_response(410, str(exc))
        except StaleWeights as exc:
            return error_response(409, str(exc), {VERSION_HEADER: str(learner.version)})
        except ExperienceFull as exc:
            return error_response(503, str(exc), {"Retry-After": "1"})
        except ValueError as exc:
            return error_response(400, str(exc))
        if since_version is not None and learner.version > since_version:
            # the actor's pull rides on its segment's answer: one round trip instead of two
            return await weights_response()
        return json_response({"version": version})

    async def stats(request: Request) -> Response:
        batcher = app.state.batchers[POLICY]
        row = learner.report()
        row["batch_sizes"] = {str(k): v for k, v in sorted(batcher.stats.batch_sizes.items())}
        return Response(json.dumps(row, default=float), media_type="application/json")

    routes = [Route("/rl/v1/info", guarded(info), methods=["GET"]),
              Route("/rl/v1/weights", guarded(weights), methods=["GET"]),
              Route("/rl/v1/segments", guarded(segments), methods=["POST"]),
              Route("/rl/v1/stats", guarded(stats), methods=["GET"])]
    app.router.routes[:0] = routes
    return app


class LearnerServer:
    """The learner's app served by uvicorn on a background thread (`start` returns the URL)."""

    def __init__(self, learner: Learner, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_batch_size: int = 256):
        self.app = create_learner_app(learner, token=token, max_batch_size=max_batch_size)
        self.host, self.port = host, port
        self.url: str | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float = 30.0) -> str:
        sock = bind_socket(self.host, self.port, reuse_port=False, listen=True)
        port = sock.getsockname()[1]
        ready = threading.Event()

        def on_ready(server: Any) -> None:
            self._server = server
            ready.set()

        def main() -> None:
            try:
                asyncio.run(serve_app(self.app, sock, on_ready=on_ready, graceful_timeout=5.0))
            except BaseException as exc:  # noqa: BLE001 - reported by start()
                self._error = exc
                ready.set()

        self._thread = threading.Thread(target=main, name="partrain-rl-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"Expected the learner's server to start within {timeout:g} s. "
                               f"Received: {self._error!r}")
        self.url = url_of(self.host, port)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
