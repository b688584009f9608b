"""Run the app with uvicorn: one process, or N replica processes behind one port.

Replicas (CPU: ``--replicas N``; CUDA: one per GPU) are separate processes, each
with its own copy of the models, its own batchers and ``cores // N`` torch
threads. They share one TCP port through ``SO_REUSEPORT`` (Linux, BSD): each
replica binds and listens on the same address and the kernel spreads incoming
connections across them, so no process is a proxy in the data path. The parent
binds the port first (without listening) to reserve it and learn it when
``port=0``, waits until every replica is ready, forwards SIGINT/SIGTERM for a
graceful shutdown (each replica finishes its in-flight requests and drains its
batchers), says in one line that it stopped, and reports a replica that dies.
A replica whose parent dies without forwarding anything (SIGKILL) shuts itself
down the same way (`partrain._process.watch_parent`).

Replica ``i`` calls itself ``partrain-replica-i`` in the server metadata
(``GET /v2``), so that what a connection reads (``/metrics`` included) can be
attributed to one replica.

``make_models(device)`` must be picklable (a module-level function or a
``functools.partial`` of one): replicas are started as every local process of
partrain is (`partrain._process.process_context`: a fork server, or ``spawn``) and
build their own models.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._process import child_started, process_context, start_child, stop_processes
from ..env import available_cores, check_cuda_device
from ..errors import UsageError, signal_name
from .protocol import ServedModel

MakeModels = Callable[..., Sequence[ServedModel]]


def bind_socket(host: str, port: int, *, reuse_port: bool, listen: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted connections only when
    # the socket says it is TCP; with proto 0, Nagle + delayed ACKs add ~40 ms per response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        if not hasattr(socket, "SO_REUSEPORT"):
            raise UsageError("Expected a platform with SO_REUSEPORT for --replicas > 1. Received: none here")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"Expected a free address to bind. Received: {host}:{port} ({exc.strerror})") from None
    if listen:
        sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def url_of(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


async def serve_app(app: Any, sock: socket.socket, *, on_ready: Callable[[Any], None] | None = None,
                    graceful_timeout: float | None = 30.0) -> None:
    """Serve ``app`` with uvicorn on a listening ``sock`` until SIGINT/SIGTERM (graceful).

    ``on_ready(server)`` is called once the server accepts connections; setting
    ``server.should_exit = True`` stops it gracefully (what the signals do).
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            # SIGINT/SIGTERM mean "stop gracefully": exit normally afterwards instead of
            # having uvicorn re-raise the signal (status -15 / KeyboardInterrupt).
            getattr(self, "_captured_signals", []).clear()

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=graceful_timeout, backlog=2048)
    server = Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started and on_ready is not None:
        on_ready(server)
    await task


def build_app(make_models: MakeModels, device: str | None, app_options: dict[str, Any]) -> Any:
    from .app import create_app

    models = make_models(device=device) if device is not None else make_models()
    return create_app(list(models), **app_options)


def _replica_main(make_models: MakeModels, index: int, host: str, port: int, threads: int,
                  device: str | None, app_options: dict[str, Any], ready: Any) -> None:
    """Entry point of one replica process."""
    # The parent forwards SIGINT/SIGTERM as SIGTERM; once serving, uvicorn handles both
    # (graceful). Until then Ctrl-C aimed at the terminal's group is the parent's to handle.
    child_started(sigterm_raises=False, grace=_ORPHAN_GRACE)
    torch.set_num_threads(threads)
    # Each replica names itself in the server metadata (GET /v2): the kernel picks the replica
    # per connection, so the name is how a client (or a test) tells whose /metrics it read.
    named = {**app_options, "server_name": f"{app_options.get('server_name', 'partrain')}-replica-{index}"}
    try:
        app = build_app(make_models, device, named)
        sock = bind_socket(host, port, reuse_port=True, listen=True)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        ready.put((index, f"{type(exc).__name__}: {exc}"))
        return
    asyncio.run(serve_app(app, sock, on_ready=lambda _server: ready.put((index, None))))


_ORPHAN_GRACE = 35.0  # seconds a replica whose parent died may drain (uvicorn's own bound is 30)


def default_threads(processes: int) -> int:
    """Torch threads per replica: the cores this process may use (affinity, cgroup quota) shared out."""
    return max(1, available_cores() // max(1, processes))


def run_server(make_models: MakeModels, *, host: str = "127.0.0.1", port: int = 8000, replicas: int = 1,
               device: str = "cpu", threads: int | None = None, app_options: dict[str, Any] | None = None,
               announce: Callable[[str], None] | None = None, start_timeout: float = 300.0) -> int:
    """Serve until interrupted; returns an exit status. ``announce(url)`` once all replicas are ready."""
    app_options = app_options or {}
    if replicas < 1:
        raise UsageError(f"Expected --replicas >= 1. Received: {replicas}")
    devices: list[str | None]
    if device.startswith("cuda"):
        check_cuda_device(torch.device(device), f"--device {device}")
        count = torch.cuda.device_count()
        if torch.device(device).index is not None:  # one named GPU: one replica on it
            replicas, devices = 1, [device]
        else:
            replicas = count if replicas == 1 else min(replicas, count)
            devices = [f"cuda:{i}" for i in range(replicas)]
    else:
        devices = [None] * replicas
    threads = threads or default_threads(replicas)

    if replicas == 1:
        torch.set_num_threads(threads)
        app = build_app(make_models, devices[0], app_options)
        sock = bind_socket(host, port, reuse_port=False, listen=True)
        bound = sock.getsockname()[1]
        asyncio.run(serve_app(app, sock, on_ready=lambda _server: _ready(announce, url_of(host, bound))))
        return 0

    reserve = bind_socket(host, port, reuse_port=True, listen=False)  # holds the port; never accepts
    bound = reserve.getsockname()[1]
    ctx = process_context()
    ready = ctx.Queue()
    procs: list[Any] = []
    stopping = False
    received: list[int] = []  # the signals that asked for the stop
    serving: list[int] = []  # replicas alive when the first one came

    def stop_all() -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGTERM)

    def forward(signum: int, frame: Any) -> None:
        if not received:
            received.append(signum)
            serving.extend(i for i, p in enumerate(procs) if p.is_alive())
        stop_all()

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(replicas):
            start_child(ctx, _replica_main, (make_models, i, host, bound, threads, devices[i], app_options, ready),
                        name=f"partrain-replica-{i}", keep=procs.append)
        waiting = set(range(replicas))
        deadline = time.monotonic() + start_timeout
        while waiting:
            if stopping:
                return 128 + received[0] if received else 1  # stopped before serving
            dead = [i for i in waiting if not procs[i].is_alive()]
            if dead:
                raise UsageError(f"Replica {dead[0]} exited with status {procs[dead[0]].exitcode} while starting")
            if time.monotonic() > deadline:
                raise UsageError(f"Expected {replicas} replicas ready within {start_timeout:.0f} s. "
                                 f"Received: {replicas - len(waiting)}")
            try:
                index, error = ready.get(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            if error:
                raise UsageError(f"Replica {index} failed to start: {error}")
            waiting.discard(index)
        if announce:
            announce(url_of(host, bound))
        status = 0
        while any(p.is_alive() for p in procs):
            for i, p in enumerate(procs):
                p.join(0.2)
                if not p.is_alive() and p.exitcode not in (0, None) and not stopping:
                    print(f"partrain serve: replica {i} exited with status {p.exitcode}; stopping",
                          file=sys.stderr)
                    status = 1
                    stop_all()
        return status
    finally:
        stop_all()
        # a graceful drain is bounded by uvicorn's timeout_graceful_shutdown (30 s)
        stop_processes(procs, grace=60.0)
        for s, handler in old.items():
            signal.signal(s, handler)
        reserve.close()
        if received:  # a server stopped by SIGTERM/SIGINT after draining has done its job: status 0
            print(f"partrain serve: stopped by {signal_name(received[0])}; {len(serving)} replica "
                  f"process{'es' if len(serving) != 1 else ''} stopped", file=sys.stderr, flush=True)


def _ready(announce: Callable[[str], None] | None, url: str) -> None:
    """The server listens: freeze what start-up allocated, then say where it serves.

    ``gc.freeze()`` moves every object alive now (torch, the model, the web stack: the
    bulk of the heap) to the collector's permanent generation, so the full collections
    that requests' many small objects (a JSON body is one float object per value)
    trigger scan only what requests allocate: shorter pauses in the latency tail.
    """
    import gc

    gc.collect()
    gc.freeze()
    if announce:
        announce(url)
