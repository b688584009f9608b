"""The HTTP app around the batcher: concurrency, queue full, auth, metrics, CLI.

Concurrent requests go through httpx's ASGITransport in one event loop (no
sockets) so that they really share batches; each answer is compared with the
model run locally. The last test starts ``partrain serve`` as a subprocess.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from partrain.checkpoint import save_checkpoint
from partrain.serve import ServedModel, TensorSpec, create_app
from partrain.serve.protocol import HEADER, decode_response, encode_request

from ..waiting import async_wait_until
from .conftest import TestClient


def test_concurrent_requests_share_batches_and_get_their_own_answers(served, digits_model) -> None:
    app = create_app([served[0]])

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            xs = [torch.randn(1 + i % 3, 1, 8, 8) for i in range(60)]

            async def one(i: int, x: torch.Tensor) -> torch.Tensor:
                body, headers = encode_request({"input": x}, binary=i % 2 == 0, binary_output=i % 3 == 0)
                r = await c.post("/v2/models/digits/infer", content=body, headers=headers)
                assert r.status_code == 200, r.text
                return decode_response(r.content, r.headers.get(HEADER))["output"]

            outs = await asyncio.gather(*(one(i, x) for i, x in enumerate(xs)))
            with torch.inference_mode():
                for x, y in zip(xs, outs):
                    torch.testing.assert_close(y, digits_model(x), rtol=1e-5, atol=1e-5)
            stats = app.state.batchers["digits"].stats
            assert stats.answered == 60 and stats.batches < 60  # batching happened
            await app.state.batchers["digits"].stop()

    asyncio.run(main())


def test_queue_full_is_503_with_retry_after() -> None:
    release = threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        release.wait(10)
        return x

    spec = [TensorSpec("input", "FP32", (-1, 2))]
    model = ServedModel("slow", slow, spec, [TensorSpec("output", "FP32", (-1, 2))], max_batch_size=1,
                        max_queue=1, policy="none")
    app = create_app([model])

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body, headers = encode_request({"input": torch.ones(1, 2)})
            batcher = app.state.batchers["slow"]
            first = asyncio.create_task(c.post("/v2/models/slow/infer", content=body, headers=headers))
            await async_wait_until(lambda: batcher.in_flight == 1, "the first request in flight (blocked)")
            second = asyncio.create_task(c.post("/v2/models/slow/infer", content=body, headers=headers))
            await async_wait_until(lambda: batcher.queue_depth == 1, "the second request queued")
            r = await c.post("/v2/models/slow/infer", content=body, headers=headers)
            assert r.status_code == 503 and r.headers["retry-after"] == "1" and "queue is full" in r.json()["error"]
            release.set()
            assert (await first).status_code == 200 and (await second).status_code == 200
            await app.state.batchers["slow"].stop()

    asyncio.run(main())


def test_request_timeout_parameter_gives_504_and_model_error_gives_500() -> None:
    release = threading.Event()

    def model(x: torch.Tensor) -> torch.Tensor:
        if (x < 0).any():
            raise ValueError("negative")
        release.wait(10)
        return x

    spec = [TensorSpec("input", "FP32", (-1, 1))]
    app = create_app([ServedModel("m", model, spec, [TensorSpec("output", "FP32", (-1, 1))],
                                  max_batch_size=1, policy="none")])

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body, headers = encode_request({"input": torch.ones(1, 1)})
            first = asyncio.create_task(c.post("/v2/models/m/infer", content=body, headers=headers))
            batcher = app.state.batchers["m"]
            await async_wait_until(lambda: batcher.in_flight == 1, "the first request in flight (blocked)")
            body2, headers2 = encode_request({"input": torch.ones(1, 1)}, timeout_us=20_000)
            r = await c.post("/v2/models/m/infer", content=body2, headers=headers2)
            assert r.status_code == 504 and "timeout" in r.json()["error"]
            release.set()
            assert (await first).status_code == 200
            body3, headers3 = encode_request({"input": -torch.ones(1, 1)})
            r = await c.post("/v2/models/m/infer", content=body3, headers=headers3)
            assert r.status_code == 500 and "negative" in r.json()["error"]
            await app.state.batchers["m"].stop()

    asyncio.run(main())


def test_bearer_token_guards_all_but_health(served) -> None:
    app = create_app([served[0]], token="s3cret")
    with TestClient(app) as c:
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").status_code == 200
        for path in ("/v2", "/v2/models/digits", "/metrics"):
            r = c.get(path)
            assert r.status_code == 401 and "Bearer" in r.json()["error"]
            assert r.headers["www-authenticate"] == "Bearer"
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        body, headers = encode_request({"input": torch.zeros(1, 1, 8, 8)})
        assert c.post("/v2/models/digits/infer", content=body, headers=headers).status_code == 401
        headers["Authorization"] = "Bearer s3cret"
        assert c.post("/v2/models/digits/infer", content=body, headers=headers).status_code == 200


def test_metrics_count_requests_errors_batches_and_queue(served) -> None:
    app = create_app([served[0]])
    with TestClient(app) as c:
        body, headers = encode_request({"input": torch.zeros(2, 1, 8, 8)})
        for _ in range(3):
            assert c.post("/v2/models/digits/infer", content=body, headers=headers).status_code == 200
        assert c.post("/v2/models/digits/infer", content=b"{").status_code == 400
        text = c.get("/metrics").text
    assert 'partrain_inference_requests_total{model="digits"} 4.0' in text
    assert 'partrain_inference_errors_total{code="400",model="digits"} 1.0' in text
    assert 'partrain_batch_size_sum{model="digits"} 6.0' in text
    assert 'partrain_request_latency_seconds_count{model="digits"} 4.0' in text
    assert 'partrain_queue_depth{model="digits"} 0.0' in text


def test_create_app_validates_its_arguments(served) -> None:
    with pytest.raises(ValueError, match="at least one model"):
        create_app([])
    with pytest.raises(ValueError, match="distinct"):
        create_app([served[0], served[0]])
    with pytest.raises(ValueError, match="keyed by their name"):
        create_app({"other": served[0]})


def test_models_listing_is_the_repository_index_of_exactly_the_served_models(served) -> None:
    """GET /v2/models (KServe's path) and POST /v2/repository/index (Triton's) list every model."""
    with TestClient(create_app(served)) as c:
        listing = c.get("/v2/models").json()
        index = c.post("/v2/repository/index").json()
        ready_only = c.post("/v2/repository/index", json={"ready": True}).json()
        metadata = {m.name: c.get(f"/v2/models/{m.name}").json() for m in served}
    assert [entry["name"] for entry in listing["models"]] == [m.name for m in served]
    for entry in listing["models"]:
        meta = metadata[entry["name"]]
        assert entry == {"name": meta["name"], "version": meta["versions"][0], "versions": meta["versions"],
                         "platform": meta["platform"], "state": "READY", "reason": ""}
    assert index == listing["models"] and ready_only == listing["models"]
    assert {e["name"]: e["version"] for e in index}["pair"] == "7"


def test_models_listing_says_unavailable_before_start_and_needs_the_token(served) -> None:
    app = create_app([served[0]], token="s3cret")

    async def main() -> None:  # an ASGI client without the lifespan: the batchers have not started
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/v2/models")).status_code == 401
            auth = {"Authorization": "Bearer s3cret"}
            (entry,) = (await c.get("/v2/models", headers=auth)).json()["models"]
            assert (entry["state"], entry["reason"]) == ("UNAVAILABLE", "not started")
            assert (await c.post("/v2/repository/index", json={"ready": True}, headers=auth)).json() == []

    asyncio.run(main())


def test_partrain_serve_names_each_model_and_its_url(monkeypatch, capsys) -> None:
    """The startup line: one per model, with its inference URL; the benchmark still finds the base URL."""
    from partrain.bench.serve import OURS_ANNOUNCE
    from partrain.cli import main
    from partrain.serve import cli as serve_cli

    def fake_run_server(make_models, *, announce, **kw) -> int:
        announce("http://127.0.0.1:8123")
        return 0

    monkeypatch.setattr(serve_cli, "run_server", fake_run_server)
    assert main(["serve", "tests.serve.test_loading:regressor_flat", "digits=runs/x/checkpoint.pt"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "partrain serve: serving model 'regressor_flat' at http://127.0.0.1:8123/v2/models/regressor_flat/infer",
        "partrain serve: serving model 'digits' at http://127.0.0.1:8123/v2/models/digits/infer",
    ]
    assert OURS_ANNOUNCE.search(lines[0]).group("url") == "http://127.0.0.1:8123"


# ----------------------------------------------------------------- partrain serve (subprocess)


def _wait_for_url(proc: subprocess.Popen, timeout: float) -> str:
    """The URL ``partrain serve`` prints once it accepts connections; fail after ``timeout`` seconds.

    A thread reads the output line by line (a blocking readline would outlive any
    timeout) and keeps draining it afterwards, so a talkative server never blocks on a
    full pipe.
    """
    lines: queue.Queue[str | None] = queue.Queue()

    def drain() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # end of output: the process exited

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        m = re.search(r"http://127\.0\.0\.1:\d+", line)
        if m:
            return m.group(0)
    raise AssertionError(f"partrain serve did not print its URL within {timeout:g} s: {''.join(seen)}")


def test_partrain_serve_checkpoint_starts_and_answers(tmp_path, digits_model) -> None:
    ckpt = tmp_path / "digits.pt"
    save_checkpoint(str(ckpt), {"model": digits_model.state_dict(),
                                "model_spec": {"name": "cnn", "kwargs": {}, "input_shape": [1, 8, 8],
                                               "num_classes": 10}})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "partrain", "serve", f"net={ckpt}", "--port", "0", "--threads", "1",
         "--token", "tok"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    try:
        url = _wait_for_url(proc, 60)
        x = torch.randn(3, 1, 8, 8)
        body, headers = encode_request({"input": x}, binary=True, binary_output=True)
        headers["Authorization"] = "Bearer tok"
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/v2/health/ready").json() == {"ready": True}
            r = c.post("/v2/models/net/infer", content=body, headers=headers)
            assert r.status_code == 200, r.text
            got = decode_response(r.content, r.headers.get(HEADER))["output"]
        with torch.inference_mode():
            torch.testing.assert_close(got, digits_model(x), rtol=1e-5, atol=1e-5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_partrain_serve_bad_input_is_one_line_exit_2(tmp_path, capsys) -> None:
    from partrain.cli import main

    cases = [
        ([str(tmp_path / "missing.pt")], "no such file"),
        (["m=tests.serve.conftest:echo_model"], "callable without arguments"),
        (["x.pt", "--policy", "sometimes"], "Expected a batching policy"),
        (["x.pt", "--max-batch-size", "0"], "Expected --max-batch-size >= 1"),
        (["x.pt", "--input-shape", "1,a"], "Expected --input-shape"),
        (["x.pt", "--device", "gpu"], "Expected --device cpu, cuda or cuda:N. Received: 'gpu'"),
    ]
    if not torch.cuda.is_available():  # a GPU named where there is none: one line before any model loads
        cases.append((["x.pt", "--device", "cuda:1"], "Expected a CUDA device for --device cuda:1. Received: "
                                                       "none visible"))
    for argv, message in cases:
        assert main(["serve", *argv, "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
