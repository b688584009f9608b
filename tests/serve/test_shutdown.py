"""Graceful shutdown loses nothing: requests in flight when the server is told to
stop are all answered, in one process (uvicorn in a thread) and with replicas
(``partrain serve --replicas 2`` stopped with SIGTERM).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import torch

from partrain.serve import ServedModel, create_app
from partrain.serve.protocol import HEADER, decode_response, encode_request
from partrain.serve.replicas import _bind, serve_app

from .test_app import _wait_for_url


class Slow(torch.nn.Module):
    """Doubles its input after 30 ms per batch: long enough to be caught in flight."""

    example_input_shape = (3,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return x * 2


class Slower(Slow):
    """400 ms per batch: work is still queued in the replicas long after every request is sent."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.4)
        return x * 2


def slower_factory() -> torch.nn.Module:
    return Slower()


def _post(url: str, x: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    body, headers = encode_request({"input": x})
    with httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/v2/models/slow/infer", content=body, headers=headers)
    if r.status_code != 200:
        return r.status_code, None
    return 200, decode_response(r.content, r.headers.get(HEADER))["output"]


def test_in_flight_requests_are_answered_when_uvicorn_stops() -> None:
    model = ServedModel.from_module("slow", Slow(), (3,), max_batch_size=4, policy="none")
    app = create_app([model])
    sock = _bind("127.0.0.1", 0, reuse_port=False, listen=True)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    servers: list = []
    ready = threading.Event()

    def run() -> None:
        asyncio.run(serve_app(app, sock, on_ready=lambda s: (servers.append(s), ready.set())))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert ready.wait(30)
        xs = [torch.full((1, 3), float(i)) for i in range(24)]
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(_post, url, x) for x in xs]
            deadline = time.monotonic() + 10
            while app.state.batchers["slow"].stats.submitted < 24 and time.monotonic() < deadline:
                time.sleep(0.005)
            servers[0].should_exit = True  # what SIGTERM does: stop accepting, finish in-flight
            results = [f.result(timeout=30) for f in futures]
        thread.join(30)
        assert not thread.is_alive()
        for x, (status, y) in zip(xs, results):
            assert status == 200 and torch.equal(y, x * 2)
        stats = app.state.batchers["slow"].stats
        assert stats.answered == 24 and stats.batches >= 6  # 24 rows, at most 4 per batch
    finally:
        sock.close()


def test_replicas_share_one_port_and_sigterm_loses_nothing() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "partrain", "serve", "slow=tests.serve.test_shutdown:slower_factory",
         "--replicas", "2", "--threads", "1", "--port", "0", "--max-batch-size", "1", "--policy", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    try:
        url = _wait_for_url(proc, 120)
        xs = [torch.full((1, 3), float(i)) for i in range(12)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(_post, url, x) for x in xs]
            # Give every request time to reach a replica (a request still unsent when the
            # server stops is refused, not lost); 12 rows at one per 400 ms batch keep the
            # two replicas busy for about 2.4 s, so most are queued when SIGTERM arrives.
            time.sleep(1.2)
            proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=60) for f in futures]
        for x, (status, y) in zip(xs, results):
            assert status == 200 and torch.equal(y, x * 2)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_listening_socket_is_tcp_so_asyncio_disables_nagle() -> None:
    """asyncio sets TCP_NODELAY on accepted connections only for proto=IPPROTO_TCP
    sockets; without it every response waited ~40 ms for a delayed ACK."""
    import socket

    sock = _bind("127.0.0.1", 0, reuse_port=True, listen=True)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
