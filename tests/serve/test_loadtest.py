"""`partrain loadtest` against a small Open Inference Protocol server on a loopback port.

Why: the benchmark's verdicts (throughput, "zero lost or wrong answers") are only as
good as the load generator's bookkeeping. These tests check that it counts exactly
(every request one outcome, closed and open loop, JSON and binary), that it notices
a server returning wrong numbers or another request's answer, that it reports errors
by kind, and that bad input is one line, exit status 2.

The server here is a deliberately plain OIP endpoint (`fake_app`) whose misbehaviour
is chosen per request id, so every expected count is known exactly. Start reading at
`test_closed_loop_counts_every_request`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import numpy as np
import pytest
import torch

from partrain.cli import main
from partrain.models import mlp
from partrain.serve.loadtest import (
    AnswerChecker,
    LoadConfig,
    load_reference_model,
    parse_target,
    prepare,
    read_answer,
    run_load,
)

from ..waiting import wait_until

uvicorn = pytest.importorskip("uvicorn")
starlette = pytest.importorskip("starlette")


def tiny_model() -> torch.nn.Module:
    """The served model; seeded so the checker's copy has the same weights."""
    torch.manual_seed(0)
    return mlp(in_features=4, num_classes=3, hidden=8, depth=1).eval()


def other_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return mlp(in_features=4, num_classes=3, hidden=8, depth=1).eval()


def fake_app(model: torch.nn.Module, misbehave: dict[str, int] | None = None):
    """An OIP v2 endpoint for one model named "tiny"; ``misbehave`` maps a fault to a period:

    - ``"wrong"``: requests whose id is a multiple get numbers off by 0.5
    - ``"swap"``: requests whose id is a multiple get another id back
    - ``"503"``: requests whose id is a multiple get HTTP 503
    - ``"slow"``: requests whose id is a multiple are held unanswered until the server closes
      (``app.state.release``, set by the ``serve`` fixture), so they always time out
    """
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    faults = misbehave or {}
    release = threading.Event()
    metadata = {"name": "tiny", "versions": ["1"], "platform": "pytorch",
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}],
                "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 3]}]}

    def hit(fault: str, request_id: int) -> bool:
        return fault in faults and request_id % faults[fault] == 0

    async def meta(request: Request) -> Response:
        if request.path_params["name"] != "tiny":
            return JSONResponse({"error": "unknown model"}, status_code=404)
        return JSONResponse(metadata)

    async def infer(request: Request) -> Response:
        body = await request.body()
        length = request.headers.get("inference-header-content-length")
        header = json.loads(body[: int(length)] if length else body)
        (inp,) = header["inputs"]
        if length:
            x = np.frombuffer(body[int(length):], dtype="<f4").reshape(inp["shape"])
        else:
            x = np.asarray(inp["data"], dtype="float32").reshape(inp["shape"])
        rid = int(header["id"])
        if hit("503", rid):
            return JSONResponse({"error": "busy"}, status_code=503, headers={"Retry-After": "1"})
        if hit("slow", rid):
            # held until teardown (bounded): no answer can beat any client timeout
            await asyncio.get_running_loop().run_in_executor(None, release.wait, 120)
            return JSONResponse({"error": "server closing"}, status_code=503)
        with torch.inference_mode():
            y = model(torch.from_numpy(x.copy())).numpy()
        if hit("wrong", rid):
            y = y + 0.5
        out_id = str(rid + 1) if hit("swap", rid) else header["id"]
        out = {"name": "output", "datatype": "FP32", "shape": list(y.shape)}
        if (header.get("parameters") or {}).get("binary_data_output"):
            raw = y.astype("<f4").tobytes()
            out["parameters"] = {"binary_data_size": len(raw)}
            head = json.dumps({"id": out_id, "model_name": "tiny", "outputs": [out]}).encode()
            return Response(head + raw, headers={"Inference-Header-Content-Length": str(len(head))},
                            media_type="application/octet-stream")
        out["data"] = y.reshape(-1).tolist()
        return JSONResponse({"id": out_id, "model_name": "tiny", "outputs": [out]})

    app = Starlette(routes=[Route("/v2/models/{name}", meta),
                            Route("/v2/models/{name}/infer", infer, methods=["POST"])])
    app.state.release = release
    return app


class ServerThread:
    """uvicorn serving ``app`` on a free loopback port in a thread; stopped in `close`."""

    def __init__(self, app, lifespan: str = "off"):
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for a socket
        # that names TCP (with proto 0, every request after the first on a connection waited ~40 ms
        # for Nagle's algorithm and streamed events arrived in one piece)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="error", lifespan=lifespan)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "the test server to start")

    def close(self) -> None:
        release = getattr(self.server.config.app.state, "release", None)
        if release is not None:
            release.set()  # let held requests end, or uvicorn waits for them on exit
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture()
def serve_partrain():
    """partrain's own OIP app (`partrain.serve.create_app`) with the tiny model, batching on."""
    app_module = pytest.importorskip("partrain.serve.app")
    from partrain.serve.protocol import ServedModel

    servers = []

    def start(**settings):
        model = ServedModel.from_module("tiny", tiny_model(), (4,), **settings)
        server = ServerThread(app_module.create_app([model]), lifespan="on")
        servers.append(server)
        return server.url

    yield start
    for s in servers:
        s.close()


def checked_run(url: str, **kw) -> object:
    cfg = LoadConfig(url=url, model="tiny", samples=8, timeout=5.0, **kw)
    info, samples, checker = prepare(cfg, check="tests.serve.test_loadtest:tiny_model")
    return run_load(cfg, samples=samples, checker=checker, info=info)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_closed_loop_counts_every_request(serve, binary):
    url = serve()
    report = checked_run(url, concurrency=4, requests=40, binary=binary)
    assert (report.sent, report.ok, report.failed) == (40, 40, 0)
    assert (report.missing, report.duplicates, report.id_mismatches, report.lost) == (0, 0, 0, 0)
    assert (report.checked, report.wrong) == (40, 0)
    figures = report.figures()
    assert figures["ok"] == 40 and figures["p50_ms"] <= figures["p99_ms"]


@pytest.mark.parametrize("arrivals", ["poisson", "uniform"])
def test_open_loop_counts_every_request(serve, arrivals):
    url = serve()
    report = checked_run(url, rate=400.0, arrivals=arrivals, requests=30)
    assert (report.sent, report.ok, report.lost, report.wrong, report.checked) == (30, 30, 0, 0, 30)
    assert "open loop" in report.mode


@pytest.mark.parametrize("loop", [{"concurrency": 3}, {"rate": 300.0}], ids=["closed", "open"])
def test_duration_bound_run_accounts_for_every_request(serve, loop):
    url = serve()
    report = checked_run(url, duration=0.3, **loop)
    assert report.sent > 0
    assert report.ok + report.failed == report.sent
    assert report.lost == 0 and report.wrong == 0 and report.checked == report.ok


def test_detects_wrong_numbers(serve):
    url = serve({"wrong": 4})
    report = checked_run(url, concurrency=2, requests=20)
    assert report.ok == 20
    assert report.wrong == 5  # ids 0, 4, 8, 12, 16
    assert "differs by up to 0.5" in report.first_wrong


def test_detects_another_requests_answer(serve):
    url = serve({"swap": 5})
    report = checked_run(url, concurrency=2, requests=20)
    assert report.id_mismatches == 4 and report.lost == 4


def test_detects_a_different_model(serve):
    url = serve(model=other_model())
    report = checked_run(url, concurrency=2, requests=10)
    assert report.wrong == 10


def test_reports_errors_by_kind(serve):
    url = serve({"503": 5, "slow": 7})
    # 3 s: far above a normal answer even at load average 8; the slow ones never answer in time
    cfg = LoadConfig(url=url, model="tiny", concurrency=4, requests=35, timeout=3.0, samples=4)
    report = run_load(cfg)
    # 503: ids 0,5,...,30 (7); slow (timed out): 7,14,21,28 (35 excluded: 35 requests are 0..34)
    assert report.errors["HTTP 503"] == 7
    assert report.errors["timeout"] == 4
    assert report.ok == 35 - 11 and report.sent == 35 and report.lost == 0


def test_whole_run_is_bounded(serve):
    url = serve({"slow": 1})
    # every answer is held: each client sends one request (at once) and the 1 s bound cancels both
    cfg = LoadConfig(url=url, model="tiny", concurrency=2, requests=4, timeout=5.0, max_time=1.0, samples=2)
    report = run_load(cfg)
    assert report.ok == 0 and report.sent == 2 and report.errors["cancelled"] == 2


def test_npz_inputs_and_checkpoint_reference(serve, tmp_path):
    from partrain.checkpoint import save_checkpoint

    model = tiny_model()
    save_checkpoint(str(tmp_path / "tiny.pt"), {
        "model": model.state_dict(),
        "model_spec": {"name": "mlp", "kwargs": {"in_features": 4, "num_classes": 3, "hidden": 8, "depth": 1},
                       "input_shape": [4], "num_classes": 3},
    })
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(0).standard_normal((6, 4)).astype("float32"))
    url = serve()
    cfg = LoadConfig(url=url, model="tiny", concurrency=2, requests=12, npz=str(tmp_path / "x.npz"))
    info, samples, checker = prepare(cfg, check=f"tiny={tmp_path / 'tiny.pt'}")
    assert len(samples) == 6 and samples[0]["input"].shape == (1, 4)
    report = run_load(cfg, samples=samples, checker=checker, info=info)
    assert (report.ok, report.checked, report.wrong) == (12, 12, 0)


def test_cli_reports_and_writes_json(serve, tmp_path, capsys):
    url = serve()
    out = tmp_path / "load.json"
    code = main(["loadtest", f"{url}/v2/models/tiny", "-c", "2", "-n", "10", "--binary",
                 "--check", "tests.serve.test_loadtest:tiny_model", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "exactly one answer each: yes" in text and "all right" in text
    figures = json.loads(out.read_text())
    assert figures["ok"] == 10 and figures["wrong"] == 0 and figures["lost"] == 0


def test_cli_exit_status_1_on_wrong_answers(serve, capsys):
    url = serve({"wrong": 3})
    code = main(["loadtest", url, "--model", "tiny", "-n", "6", "--check", "tests.serve.test_loadtest:tiny_model"])
    assert code == 1 and "2 WRONG" in capsys.readouterr().out


def test_cli_exit_status_1_when_every_request_fails(serve, capsys):
    """Issue 10: every request failed, yet exit 0 and "exactly one answer each: yes"."""
    url = serve({"503": 1})
    code = main(["loadtest", url, "--model", "tiny", "-c", "1", "-n", "5"])
    captured = capsys.readouterr()
    assert code == 1
    assert "exactly one answer each: yes" not in captured.out
    assert "exactly one answer each: no answers to check, 0 of 5 answered (missing 0" in captured.out
    assert captured.err == ("partrain loadtest: FAILED: 5 of 5 requests failed (error rate 1 > "
                            "--max-error-rate 0); first: request 0: HTTP 503: busy\n")


@pytest.mark.parametrize(("max_rate", "code"), [(None, 1), ("0.1", 1), ("0.2", 0), ("1", 0)])
def test_cli_max_error_rate_decides_the_exit_status(serve, capsys, max_rate, code):
    url = serve({"503": 5})  # ids 0, 5, 10, 15: 4 of 20 fail, a rate of exactly 0.2
    argv = ["loadtest", url, "--model", "tiny", "-c", "2", "-n", "20"]
    if max_rate is not None:
        argv += ["--max-error-rate", max_rate]
    assert main(argv) == code
    captured = capsys.readouterr()
    assert "answered  16 of 20" in captured.out and "HTTP 503: 4 (first: request " in captured.out
    assert ("4 of 20 requests failed (error rate 0.2 > --max-error-rate" in captured.err) == (code == 1)


def test_cli_nan_inputs_over_json_are_one_line(serve, tmp_path, capsys):
    np.savez(tmp_path / "x.npz", x=np.array([[1.0, np.nan, 2.0, 3.0]], dtype="float32"))
    url = serve()
    assert main(["loadtest", url, "-m", "tiny", "-n", "1", "--npz", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Received: 1 NaN in input 'input' of sample 0; send them with --binary" in err


def test_partrain_server_refusing_every_request_fails_the_run_with_its_line(serve_partrain, capsys):
    """Requests partrain's server refuses (a 400 for a shape it cannot take): exit 1, its line shown."""
    url = serve_partrain()
    code = main(["loadtest", url, "-m", "tiny", "-n", "4", "--shape", "1,5"])
    captured = capsys.readouterr()
    assert code == 1, captured
    assert captured.err.count("\n") == 1
    assert ("4 of 4 requests failed (error rate 1 > --max-error-rate 0); first: request 0: HTTP 400: "
            "Expected input 'input' of shape [-1, 4] (-1: any). Received: [1, 5]") in captured.err


@pytest.fixture()
def dead_port():
    """A port bound but not listening: connections are refused, and nobody else can take it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize("argv, message", [
    (["http://127.0.0.1:{port}", "-m", "tiny", "-n", "1", "--connect-timeout", "2"],
     "Expected a reachable server at http://127.0.0.1:{port}"),
    (["{url}", "-m", "nope", "-n", "1"], "Expected a model named 'nope'"),
    (["{url}", "-n", "1"], "Expected a model name"),
    (["{url}/v2/models/tiny", "-c", "0", "-n", "1"], "Expected a positive concurrency. Received: concurrency=0"),
    (["{url}/v2/models/tiny", "-r", "-5"], "Expected a positive rate"),
    (["ftp://x", "-m", "tiny"], "Expected an http:// or https:// URL"),
    (["{url}/v2/models/tiny", "--shape", "1,5"], "Expected the --check model to accept the inputs sent"),
    (["{url}/v2/models/tiny", "--npz", "/nonexistent.npz"], "(no such file)"),
    # output paths are checked before anything is sent (here the server is not even reachable)
    (["http://127.0.0.1:{port}", "-m", "tiny", "--json", "{tmp}/no/such/dir/x.json"],
     "Expected --json in an existing directory. Received: '{tmp}/no/such/dir/x.json' ('{tmp}/no/such/dir' "
     "does not exist)"),
    (["http://127.0.0.1:{port}", "-m", "tiny", "--json", "{tmp}"],
     "Expected a file to write for --json. Received: '{tmp}', a directory"),
    (["http://127.0.0.1:{port}", "-m", "tiny", "--json", ""], "Expected a file name for --json"),
    (["{url}/v2/models/tiny", "--max-error-rate", "1.5"], "Expected --max-error-rate between 0 and 1. Received: 1.5"),
])
def test_cli_bad_input_is_one_line(serve, dead_port, tmp_path, capsys, argv, message):
    url = serve()
    port = dead_port
    argv = [a.format(url=url, port=port, tmp=tmp_path) for a in argv]
    message = message.format(port=port, tmp=tmp_path)
    if "--shape" in argv:
        argv += ["--check", "tests.serve.test_loadtest:tiny_model"]
    code = main(["loadtest", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_parse_target_and_decode():
    assert parse_target("http://h:1/v2/models/m/", None) == ("http://h:1", "m")
    assert parse_target("http://h:1/prefix", "m") == ("http://h:1/prefix", "m")
    head = json.dumps({"id": "3", "outputs": [
        {"name": "a", "datatype": "INT64", "shape": [1, 2], "data": [1, 2]},
        {"name": "b", "datatype": "FP16", "shape": [2], "parameters": {"binary_data_size": 4}}]}).encode()
    raw = np.array([1.5, -2], dtype="<f2").tobytes()
    rid, outs = read_answer(head + raw, {"Inference-Header-Content-Length": str(len(head))})
    assert rid == "3" and outs["a"].tolist() == [[1, 2]] and outs["b"].tolist() == [1.5, -2.0]


def test_checker_compares_with_tolerance():
    model = tiny_model()
    x = {"input": np.ones((1, 4), "float32")}
    checker = AnswerChecker(load_reference_model("tests.serve.test_loadtest:tiny_model"), [x], atol=1e-3, rtol=0)
    y = model(torch.from_numpy(x["input"])).detach().numpy()
    assert checker.compare(0, {"output": y + 5e-4}) == ""
    assert "differs" in checker.compare(0, {"output": y + 2e-3})
    assert "shape" in checker.compare(0, {"output": y.reshape(-1)})


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("loop", [{"concurrency": 8, "requests": 64}, {"rate": 500.0, "requests": 64}],
                         ids=["closed", "open"])
def test_partrain_server_answers_each_request_once_and_right(serve_partrain, binary, loop):
    """The real app with adaptive batching: the load generator sees no lost or wrong answer."""
    url = serve_partrain(max_batch_size=8)
    report = checked_run(url, binary=binary, **loop)
    assert (report.sent, report.ok, report.failed) == (64, 64, 0)
    assert (report.lost, report.checked, report.wrong) == (0, 64, 0)


def test_partrain_server_unknown_model_is_one_line(serve_partrain, capsys):
    url = serve_partrain()
    assert main(["loadtest", url, "-m", "nope", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert "Expected a model named 'nope'" in err and err.count("\n") == 1
