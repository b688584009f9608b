"""Graceful shutdown loses nothing: requests in flight when the server is told to
stop are all answered, in one process (uvicorn in a thread) and with replicas
(``partrain serve --replicas 2`` stopped with SIGTERM).

No test guesses how long a request takes to arrive: they wait until the batcher
(or each replica's metrics) has counted every request, and the replica test
holds every batch until the signal has taken effect.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import torch

from partrain.serve import ServedModel, create_app
from partrain.serve.protocol import HEADER, decode_response, encode_request
from partrain.serve.replicas import bind_socket, serve_app

from ..waiting import wait_until
from .test_app import _wait_for_url


class Slow(torch.nn.Module):
    """Doubles its input after 30 ms per batch: long enough to be caught in flight."""

    example_input_shape = (3,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return x * 2


HOLD = "PARTRAIN_TEST_HOLD"  # environment variable: a file that, while it exists, holds every batch


class Held(Slow):
    """Doubles its input, but holds each batch while the file named by $PARTRAIN_TEST_HOLD exists.

    The test creates the file once the server is up and removes it after SIGTERM took
    effect, so the requests are provably in flight or queued in the replicas when the
    signal arrives; the example run at start-up (no file yet) passes straight through.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hold = os.environ.get(HOLD, "")
        deadline = time.monotonic() + 60  # bounded: a test that never releases fails, never hangs
        while hold and os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.005)  # polling the hold file, not a guessed duration
        return x * 2


def held_factory() -> torch.nn.Module:
    return Held()


def _post(url: str, x: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    body, headers = encode_request({"input": x})
    with httpx.Client(base_url=url, timeout=120) as c:  # held requests wait for the test's release
        r = c.post("/v2/models/slow/infer", content=body, headers=headers)
    if r.status_code != 200:
        return r.status_code, None
    return 200, decode_response(r.content, r.headers.get(HEADER))["output"]


def test_in_flight_requests_are_answered_when_uvicorn_stops() -> None:
    model = ServedModel.from_module("slow", Slow(), (3,), max_batch_size=4, policy="none")
    app = create_app([model])
    sock = bind_socket("127.0.0.1", 0, reuse_port=False, listen=True)
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
            wait_until(lambda: app.state.batchers["slow"].stats.submitted == 24, "all 24 requests submitted")
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


def _requests_per_replica(url: str, seen: dict[str, int]) -> int:
    """Read one replica's request count into ``seen`` (name -> count); return the sum over replicas.

    A new connection lands on a replica of the kernel's choosing; the server
    metadata names it, and /metrics read over the same keep-alive connection is
    that replica's.
    """
    with httpx.Client(base_url=url, timeout=10) as c:
        name = c.get("/v2").json()["name"]
        text = c.get("/metrics").text
        if c.get("/v2").json()["name"] == name:  # the same connection throughout
            m = re.search(r'partrain_inference_requests_total\{model="slow"\} ([0-9.e+]+)', text)
            seen[name] = int(float(m.group(1))) if m else 0
    return sum(seen.values())


def _refused(url: str) -> bool:
    """True once no replica accepts connections any more (all are shutting down)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:  # the listener closed with this connection in its backlog: ask again
        return False
    return False


def test_replicas_share_one_port_and_sigterm_loses_nothing(tmp_path) -> None:
    hold = tmp_path / "hold"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", HOLD: str(hold)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "partrain", "serve", "slow=tests.serve.test_shutdown:held_factory",
         "--replicas", "2", "--threads", "1", "--port", "0", "--max-batch-size", "1", "--policy", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    try:
        url = _wait_for_url(proc, 120)
        hold.touch()  # from now on every batch waits: requests pile up in the replicas
        xs = [torch.full((1, 3), float(i)) for i in range(12)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(_post, url, x) for x in xs]
            # A request still unsent when the server stops is refused, not lost: wait until
            # all 12 reached a replica (each one in flight or queued there, held).
            seen: dict[str, int] = {}
            wait_until(lambda: _requests_per_replica(url, seen) == 12, "all 12 requests to reach a replica")
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: _refused(url), "every replica to stop accepting connections")
            hold.unlink()  # only now may the held batches finish: the drain has to answer them
            results = [f.result(timeout=60) for f in futures]
        for x, (status, y) in zip(xs, results):
            assert status == 200 and torch.equal(y, x * 2)
        assert proc.wait(60) == 0
    finally:
        if hold.exists():
            hold.unlink()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_listening_socket_is_tcp_so_asyncio_disables_nagle() -> None:
    """asyncio sets TCP_NODELAY on accepted connections only for proto=IPPROTO_TCP
    sockets; without it every response waited ~40 ms for a delayed ACK."""
    sock = bind_socket("127.0.0.1", 0, reuse_port=True, listen=True)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
