"""`partrain loadtest --generate`: prompts, stream timing, the greedy check, and a real server.

Why: the generate benchmark's verdicts (tokens/s, TTFT, TPOT, "every greedy answer right")
rest on the load generator reading each stream exactly: the tokens of every event, the
time the first token arrived, the answer's length against what was asked. The pure parts
are tested with injected times (no real duration is asserted); then the real app
(`partrain.serve.create_app` over a tiny GPT from a module:factory, as ``partrain serve``
loads it) is loaded closed and open loop and every greedy answer checked against the model
alone. A fake streaming server supplies the faults a healthy one never shows.

Start reading at `test_a_real_server_answers_every_greedy_request_right`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from partrain.cli import main
from partrain.models.gpt import GPT
from partrain.serve.loadtest import (
    GenerateReport,
    GenerateSettings,
    GreedyChecker,
    LoadConfig,
    Prompt,
)
from partrain.serve.loadtest.generate import (
    EventStream,
    GenerativeModel,
    StreamAnswer,
    StreamError,
    file_prompts,
    generative_model,
    miscount,
    prepare_generate,
    random_prompts,
    read_stream,
    request_body,
    run_generate,
)
from partrain.serve.loadtest.target import parse_metadata

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

BLOCK = 32
FACTORY = "tests.serve.test_loadtest_generate:tiny_gpt"


def tiny_gpt() -> GPT:
    """The served model, 256 byte tokens (so it has a tokenizer); seeded so the checker's copy is the same."""
    torch.manual_seed(0)
    return GPT(vocab_size=256, n_layer=1, n_head=2, n_embd=16, block_size=BLOCK).eval()


def other_gpt() -> GPT:
    torch.manual_seed(1)
    return GPT(vocab_size=256, n_layer=1, n_head=2, n_embd=16, block_size=BLOCK).eval()


MODEL = GenerativeModel("gen", (0, 256), BLOCK, "bytes")


# --------------------------------------------------------------------------- prompts and bodies


def test_random_prompts_fit_the_context_and_repeat_with_the_seed():
    settings = GenerateSettings(prompt_tokens=(4, 100), max_tokens=(8, 20))
    prompts = random_prompts(MODEL, settings, 200, seed=3)
    assert prompts == random_prompts(MODEL, settings, 200, seed=3)
    assert prompts != random_prompts(MODEL, settings, 200, seed=4)
    lengths = {p.length for p in prompts}
    assert min(lengths) >= 4 and max(lengths) == BLOCK - 1  # the range is cut to the context
    for p in prompts:
        assert p.ids is not None and len(p.ids) == p.length and all(0 <= t < 256 for t in p.ids)
        assert 1 <= p.max_tokens <= 20 and p.length + p.max_tokens <= BLOCK
        assert p.max_tokens >= 8 or p.length + p.max_tokens == BLOCK  # capped only where the context ends
    with pytest.raises(Exception, match="Expected prompts shorter than the context of model 'gen', 32 tokens"):
        random_prompts(MODEL, GenerateSettings(prompt_tokens=(32, 40)), 1)


def test_file_prompts_are_lines_counted_by_the_tokenizer(tmp_path):
    from partrain.serve.generation import ByteTokenizer

    path = tmp_path / "prompts.txt"
    path.write_text("hello\n\nnaïve café\n", encoding="utf-8")
    settings = GenerateSettings(prompts_file=str(path), max_tokens=(5, 5))
    prompts = file_prompts(str(path), MODEL, settings, tokenizer=ByteTokenizer())
    assert [p.text for p in prompts] == ["hello", "naïve café"]
    assert [p.length for p in prompts] == [5, 12] and prompts[1].ids == tuple("naïve café".encode())
    assert [p.max_tokens for p in prompts] == [5, 5]
    without = file_prompts(str(path), MODEL, settings)  # no tokenizer here: lengths in bytes, no ids
    assert [(p.ids, p.length) for p in without] == [(None, 5), (None, 12)]
    assert settings.ignores_eos() is False  # text: the model's end-of-text may end it
    with pytest.raises(Exception, match="Expected a model with a tokenizer for text prompts"):
        file_prompts(str(path), GenerativeModel("ids", (0, 64), BLOCK), settings)
    path.write_text("x" * 40)
    with pytest.raises(Exception, match="Received: line 1 of .* with 40"):
        file_prompts(str(path), MODEL, settings, tokenizer=ByteTokenizer())


def test_request_body_carries_the_prompt_and_parameters():
    greedy = GenerateSettings()
    body = json.loads(request_body(Prompt((1, 2), None, 2, 7, seed=9), greedy, "3"))
    assert body == {"id": "3", "input_ids": [1, 2],
                    "parameters": {"max_tokens": 7, "temperature": 0.0, "ignore_eos": True}}
    sampled = GenerateSettings(temperature=0.7, top_k=5, prompts_file="p.txt")
    body = json.loads(request_body(Prompt(None, "hi", 2, 4, seed=9), sampled, "4"))
    assert body["text_input"] == "hi" and "input_ids" not in body
    assert body["parameters"] == {"max_tokens": 4, "temperature": 0.7, "ignore_eos": False, "top_p": 1.0,
                                  "top_k": 5, "seed": 9}


def test_metadata_names_the_vocabulary_and_context():
    meta = {"name": "gen", "inputs": [{"name": "input", "datatype": "INT64", "shape": [-1, -1]}],
            "parameters": {"input_limits": {"input": {"max_shape": [-1, 32], "value_range": [0, 100]}},
                           "generate": {"max_running": 8, "block_size": 32, "tokenizer": None}}}
    assert generative_model(parse_metadata(meta, "gen")) == GenerativeModel("gen", (0, 100), 32, None)
    del meta["parameters"]["generate"]
    with pytest.raises(Exception, match="Expected a generative model .* model 'gen' without it"):
        generative_model(parse_metadata(meta, "gen"))


# --------------------------------------------------------------------------- reading the stream


def event(ids, reason=None, **extra) -> bytes:
    return b"data: " + json.dumps({"output_ids": ids, "finish_reason": reason, **extra}).encode() + b"\n\n"


def test_events_split_anywhere_keep_their_arrival_times():
    raw = event([5]) + b": keep-alive\n\n" + event([6, 7]) + event([], "length", usage={"completion_tokens": 3})
    stream = EventStream()
    for i in range(len(raw)):  # one byte at a time, the i-th at time i
        stream.feed(raw[i:i + 1], now=float(i))
    assert [obj["output_ids"] for _, obj in stream.events] == [[5], [6, 7], []]
    first = len(event([5])) - 1  # the byte that completed each event
    second = first + len(b": keep-alive\n\n") + len(event([6, 7]))
    assert [t for t, _ in stream.events] == [first, second, len(raw) - 1]
    assert stream.leftover == b""


def test_ttft_and_tpot_from_event_times():
    events = [(10.5, {"output_ids": [1], "finish_reason": None}),
              (11.0, {"output_ids": [2, 3], "finish_reason": None}),  # two tokens in one event
              (12.5, {"output_ids": [4], "finish_reason": "length", "usage": {"completion_tokens": 4}})]
    got = read_stream(events, start=10.0)
    assert got.tokens == [1, 2, 3, 4] and got.finish_reason == "length"
    assert got.ttft == 0.5
    assert got.tpot == pytest.approx((12.5 - 10.5) / 3)
    one = read_stream([(3.0, {"output_ids": [9], "finish_reason": "length"})], start=1.0)
    assert (one.ttft, one.tpot) == (2.0, None)
    nothing = read_stream([(3.0, {"output_ids": [], "finish_reason": "stop"})], start=1.0)
    assert nothing.tokens == [] and np.isnan(nothing.ttft)


@pytest.mark.parametrize("events, kind, message", [
    ([{"output_ids": [1], "finish_reason": None}, {"error": "Model 'gen' failed: boom"}], "stream error",
     "Model 'gen' failed: boom"),
    ([{"output_ids": [1], "finish_reason": None}], "malformed answer", "without a finish reason"),
    ([{"output_ids": [1], "finish_reason": "length"}, {"output_ids": [2], "finish_reason": None}],
     "malformed answer", "follows the event with the finish reason"),
    ([{"output_ids": ["a"], "finish_reason": None}], "malformed answer", "not token ids"),
    ([{"malformed": "{oops"}], "malformed answer", "is not JSON"),
    ([{"output_ids": [1], "finish_reason": "cancelled"}], "malformed answer", "finish_reason 'cancelled'"),
])
def test_streams_that_are_not_answers(events, kind, message):
    with pytest.raises(StreamError, match=message) as info:
        read_stream([(0.0, e) for e in events], start=0.0)
    assert info.value.kind == kind


def test_answers_must_have_the_tokens_asked_for():
    prompt = Prompt((1, 2, 3), None, 3, 4)

    def answer(n, reason="length", **usage):
        return StreamAnswer(list(range(n)), reason, {"prompt_tokens": 3, "completion_tokens": n, **usage}, 0.1, None)

    assert miscount(answer(4), prompt, ignore_eos=True) == ""
    assert "3 tokens with finish_reason 'length', max_tokens 4" in miscount(answer(3), prompt, True)
    assert "finish_reason 'stop' after 2 of 4 tokens with ignore_eos" in miscount(answer(2, "stop"), prompt, True)
    assert miscount(answer(2, "stop"), prompt, ignore_eos=False) == ""  # the model's end-of-text
    assert "usage says 5 completion tokens, the stream had 4" in miscount(answer(4, completion_tokens=5), prompt, True)
    assert "usage says 9 prompt tokens" in miscount(answer(4, prompt_tokens=9), prompt, True)
    assert miscount(StreamAnswer([1], "length", None, 0.1, None), prompt, True) == "no usage in the last event"


# --------------------------------------------------------------------------- the greedy check


def greedy(model: GPT, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        return model.generate(torch.tensor([prompt]), n, temperature=0)[0, len(prompt):].tolist()


def test_greedy_check_agrees_with_the_models_own_generate():
    model = tiny_gpt()
    checker = GreedyChecker(model)
    prompt = [72, 101, 108, 108, 111]
    right = greedy(model, prompt, 12)
    assert checker.compare(prompt, right) == ("", "")
    wrong = right[:5] + [(right[5] + 1) % 256] + right[6:]
    verdict, what = checker.compare(prompt, wrong)
    assert verdict == "wrong" and what.startswith(f"token 5 of 12 is {wrong[5]}; the model alone chooses {right[5]}")
    assert checker.compare(prompt, [300])[0] == "wrong"  # outside the vocabulary: one line, not a crash
    assert checker.compare(prompt, right[:0]) == ("", "")


def test_a_near_tie_is_reported_apart_from_a_wrong_answer():
    """Logits made by hand: position 0 has tokens 1 and 2 within 1e-6, position 1 prefers 3 by far."""

    def model(ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(1, ids.shape[1], 4, dtype=torch.float64)
        logits[0, :, 1], logits[0, :, 2] = 5.0, 5.0 - 1e-6
        logits[0, -1:, 3] = 9.0  # the last position (after the answer's first token) prefers 3
        return logits

    checker = GreedyChecker(model, rtol=1e-4)
    assert checker.compare([0], [1, 3]) == ("", "")
    verdict, what = checker.compare([0], [2, 3])
    assert verdict == "tie" and "token 0 of 2 is 2; the model alone chooses 1" in what
    assert checker.compare([0], [2, 1])[0] == "wrong"  # after the tie the rest is still checked
    assert GreedyChecker(model, rtol=1e-9).compare([0], [2, 3])[0] == "wrong"


# --------------------------------------------------------------------------- the report


def test_report_figures_and_lines():
    report = GenerateReport(mode="closed loop, concurrency 2", elapsed=2.0, sent=4, latencies=[0.2, 0.4, 0.6],
                            errors={"HTTP 503": 1}, workload="3 prompts", ttft=[0.01, 0.03, 0.02],
                            tpot=[0.005, 0.007], prompt_tokens=30, output_tokens=40, checked=3, ties=1,
                            first_tie="request 2: token 0", first_error="request 3: HTTP 503: busy")
    figures = report.figures()
    assert figures["output_tokens_per_s"] == 20.0 and figures["throughput_rps"] == 1.5
    assert figures["ttft_p50_ms"] == pytest.approx(20.0) and figures["tpot_p50_ms"] == pytest.approx(6.0)
    assert figures["p50_ms"] == pytest.approx(400.0) and figures["errors.HTTP 503"] == 1
    assert figures["ties"] == 1 and figures["wrong"] == 0 and figures["miscounted"] == 0
    text = report.format()
    assert "  sending   3 prompts" in text
    assert "(1.50 requests/s, 20.0 output tokens/s; 40 tokens out, 30 in)" in text
    assert "TTFT      p50 20.00 ms  p90 28.00 ms  p99 29.80 ms" in text
    assert "latency   p50 400.00 ms  p99 596.00 ms  (end to end)" in text
    assert "checked against the local model: 3, all right; 1 differ only at near-ties" in text
    assert report.failures(max_error_rate=0.25) == []
    report.miscounted, report.first_miscounted = 1, "request 1: 3 tokens"
    assert report.failures(max_error_rate=0.25) == [
        "1 of 3 answers did not have the tokens asked for; first: request 1: 3 tokens"]


# --------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def gpt_server():
    """partrain's app serving the tiny GPT as ``partrain serve NAME=module:factory`` would (module-wide)."""
    from partrain.serve import create_app
    from partrain.serve.loading import load_model_spec

    from .test_loadtest import ServerThread

    server = ServerThread(create_app([load_model_spec(f"gen={FACTORY}")]), lifespan="on")
    yield server.url
    server.close()


def small(**kw) -> GenerateSettings:
    return GenerateSettings(**{"prompt_tokens": (2, 10), "max_tokens": (1, 12), **kw})


def test_a_real_server_answers_every_greedy_request_right(gpt_server):
    cfg = LoadConfig(url=gpt_server, model="gen", concurrency=4, requests=24, samples=6, timeout=30.0)
    settings = small()
    model, prompts, checker = prepare_generate(cfg, settings, check=FACTORY)
    assert model == GenerativeModel("gen", (0, 256), BLOCK, "bytes") and checker is not None
    report = run_generate(cfg, settings, prompts, checker)
    assert (report.sent, report.ok, report.failed, report.lost) == (24, 24, 0, 0), report.format()
    assert (report.checked, report.wrong, report.miscounted) == (24, 0, 0), report.format()
    assert report.output_tokens == sum(prompts[i % 6].max_tokens for i in range(24))
    assert report.prompt_tokens == sum(prompts[i % 6].length for i in range(24))
    assert len(report.ttft) == 24 and len(report.tpot) == sum(prompts[i % 6].max_tokens > 1 for i in range(24))


def test_open_loop_and_sampled_requests(gpt_server):
    cfg = LoadConfig(url=gpt_server, model="gen", rate=200.0, arrivals="uniform", requests=12, samples=3,
                     timeout=30.0)
    settings = small(temperature=0.9, top_p=0.9)
    _, prompts, checker = prepare_generate(cfg, settings, check=FACTORY)
    assert checker is None  # sampled: nothing to check greedy answers with
    report = run_generate(cfg, settings, prompts)
    assert (report.sent, report.ok, report.lost, report.miscounted) == (12, 12, 0, 0), report.format()
    assert "open loop" in report.mode and report.checked == 0
    assert report.repeats_differ == 0  # each prompt went 4 times with its own seed: the same tokens
    assert "answers not checked (sampled at temperature 0.9: only greedy answers can be checked)" in report.format()


def test_cli_checks_text_prompts_and_writes_json(gpt_server, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello\nThe cat\nà bientôt\n", encoding="utf-8")
    out = tmp_path / "gen.json"
    code = main(["loadtest", f"{gpt_server}/v2/models/gen", "--generate", "--prompts", str(prompts),
                 "--max-tokens", "4:8", "-c", "2", "-n", "6", "--check", FACTORY, "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "/generate_stream" in text and "3 prompts of 5-11 tokens (lines of" in text
    assert "greedy answers checked against the local model: 6, all right" in text
    figures = json.loads(out.read_text())
    assert figures["ok"] == 6 and figures["wrong"] == 0 and figures["checked"] == 6
    assert {"ttft_p50_ms", "ttft_p99_ms", "tpot_p90_ms", "output_tokens_per_s", "p99_ms"} <= set(figures)


def test_cli_exit_status_1_when_answers_are_not_the_models(gpt_server, capsys):
    code = main(["loadtest", gpt_server, "-m", "gen", "--generate", "--prompt-tokens", "4:8", "--max-tokens",
                 "6", "-n", "4", "--samples", "2", "--check", "tests.serve.test_loadtest_generate:other_gpt"])
    captured = capsys.readouterr()
    assert code == 1, captured.out
    assert "4 WRONG (request 0 (prompt 0, " in captured.out
    assert captured.err.startswith("partrain loadtest: FAILED: 4 of 4 answers checked were wrong; first: request 0")


# --------------------------------------------------------------------------- faults a healthy server never shows


def faulty_app():
    """A streaming generate endpoint whose fault is chosen by request id (id % 4):
    0 a 503, 1 an error event mid-stream, 2 one token fewer than asked, 3 a right answer;
    except request 7, which stops after its first token until the server closes (a timeout)."""
    import asyncio
    import threading

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    meta = {"name": "gen", "inputs": [{"name": "input", "datatype": "INT64", "shape": [-1, -1]}],
            "parameters": {"input_limits": {"input": {"value_range": [0, 50]}},
                           "generate": {"max_running": 4, "block_size": 64, "tokenizer": None}}}

    async def metadata(request: Request) -> Response:
        return JSONResponse(meta)

    async def stream(request: Request) -> Response:
        body = json.loads(await request.body())
        rid, n = int(body["id"]), body["parameters"]["max_tokens"]
        if rid % 4 == 0:
            return JSONResponse({"error": "busy"}, status_code=503, headers={"Retry-After": "1"})
        count = n - 1 if rid % 4 == 2 else n

        async def events():
            if rid == 7:
                yield event([7])
                # held until teardown (bounded): the client's timeout must end it
                await asyncio.get_running_loop().run_in_executor(None, release.wait, 120)
                return
            for i in range(count):
                if rid % 4 == 1 and i == 1:
                    yield b'data: {"error": "Model \'gen\' failed: boom"}\n\n'
                    return
                last = i == count - 1
                yield event([7], "length" if last else None,
                            **({"usage": {"prompt_tokens": len(body["input_ids"]), "completion_tokens": count}}
                               if last else {}))

        return StreamingResponse(events(), media_type="text/event-stream")

    release = threading.Event()
    app = Starlette(routes=[Route("/v2/models/{name}", metadata),
                            Route("/v2/models/{name}/generate_stream", stream, methods=["POST"])])
    app.state.release = release  # set by ServerThread.close
    return app


def test_faults_are_counted_by_kind():
    from .test_loadtest import ServerThread

    server = ServerThread(faulty_app())
    try:
        # 3 s: far above a healthy answer here even at load average 8; request 7 never ends in time
        cfg = LoadConfig(url=server.url, model="gen", concurrency=2, requests=8, samples=2, timeout=3.0)
        settings = GenerateSettings(prompt_tokens=(3, 5), max_tokens=(3, 6))
        _, prompts, _ = prepare_generate(cfg, settings)
        report = run_generate(cfg, settings, prompts)
    finally:
        server.close()
    assert report.errors == {"HTTP 503": 2, "stream error": 2, "timeout": 1}, report.format()
    assert (report.ok, report.lost, report.miscounted) == (3, 0, 2)
    assert "with finish_reason 'length', max_tokens" in report.first_miscounted
    assert len(report.failures(max_error_rate=1.0)) == 1  # a miscounted answer fails whatever the error rate


# --------------------------------------------------------------------------- bad input: one line, exit 2


@pytest.mark.parametrize("argv, message", [
    (["--prompt-tokens", "4:8"], "Expected --generate with --prompt-tokens (a generation option). Received: "
     "--prompt-tokens alone"),
    (["--generate", "--binary"], "Expected no --binary with --generate"),
    (["--generate", "--processes", "2"], "Expected no --processes with --generate"),
    (["--generate", "--max-tokens", "9:3"], "Expected --max-tokens LOW:HIGH with 1 <= LOW <= HIGH. Received: 9:3"),
    (["--generate", "--temperature", "-1"], "Expected a temperature >= 0 (0: greedy). Received: -1.0"),
    (["--generate", "--prompts", "/nonexistent.txt"], "(no such file)"),
    (["--generate", "--prompts", "x.txt", "--prompt-tokens", "3"], "Expected one of --prompts"),
    (["--generate", "--prompt-tokens", "40:50"], "Expected prompts shorter than the context of model 'gen', 32 tokens. Received: --prompt-tokens 40:50"),
])
def test_cli_bad_input_is_one_line(gpt_server, capsys, argv, message):
    code = main(["loadtest", gpt_server, "-m", "gen", "-n", "1", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and err.count("\n") == 1


def test_cli_generate_against_a_model_that_only_infers(serve, capsys):
    url = serve()  # test_loadtest's fake server: an MLP, infer only
    assert main(["loadtest", url, "-m", "tiny", "--generate", "-n", "1"]) == 2
    err = capsys.readouterr().err
    assert "Expected a generative model (metadata with parameters.generate) for --generate" in err
    assert err.count("\n") == 1
