"""The generate extension over HTTP: ``/generate`` and ``/generate_stream`` (issue 52, items 1-3).

What it guards: a causal language model served by ``partrain serve`` answers Triton's generate
extension with what the model alone would say. Greedy answers equal the model's own
``generate`` on that one prompt (float64, so on any CPU; and the float32 checkpoint as served,
token by token up to float32's rounding), also for requests that share decode steps; the stream
adds up to the one-shot answer; a seeded draw is the same whatever else runs; stop strings,
``max_tokens`` and the context are enforced; bad requests are one-line 400s before anything
starts (never a stream that fails at once); a full queue is a 503 with ``Retry-After``; a
client that goes away frees its slot; metrics count it all.

Two models: the GPT checkpoint ``partrain train`` writes (tiny: width 16, one layer, blocks of
32 bytes), loaded as ``partrain serve`` loads it; and ``varied``, a random GPT with large
weights whose greedy continuations differ from prompt to prompt (the briefly trained checkpoint
answers "ooo..." to most prompts, which would hide a mix-up between requests). Nothing here
waits on a sleep: a test that needs a request to hold its slot closes the gate of
`GatedRunner`, and every wait polls its condition with a bound.

Start with `test_greedy_answer_equals_the_models_own_generate`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from partrain.cli import main
from partrain.errors import UsageError
from partrain.models import build_model
from partrain.models.gpt import GPT
from partrain.serve import ServedModel, TensorSpec, create_app
from partrain.serve.generation import (
    ByteTokenizer,
    GenerationEngine,
    RequestError,
    Runner,
    SamplingParams,
    runner_for,
)
from partrain.serve.generation.models import LanguageModel, engine_factory
from partrain.serve.loading import load_model_spec

from ..waiting import BOUND, async_wait_until
from .conftest import TestClient, train_tiny_gpt

BLOCK = 32


# --------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return train_tiny_gpt(tmp_path_factory.mktemp("gpt"), BLOCK)


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> GPT:
    """The trained model as its spec builds it, called directly (float32, as served)."""
    state = torch.load(checkpoint, weights_only=True)
    model = build_model("gpt", **state["model_spec"]["kwargs"])
    model.load_state_dict(state["model"])
    return model.eval()


@pytest.fixture(scope="module")
def varied() -> GPT:
    """A random float64 GPT over 128 byte tokens (ASCII: its text always decodes) with weights large
    enough that its greedy continuations differ from prompt to prompt."""
    torch.manual_seed(0)
    model = GPT(vocab_size=128, n_layer=1, n_head=2, n_embd=16, block_size=BLOCK).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20)
    return model


class GatedRunner(Runner):
    """``inner``'s runner, whose decode steps wait while ``gate`` is closed (open by default).

    A test closes the gate to hold a request in its slot (the engine's thread waits inside a
    decode step) until it has set up what it checks, then opens it.
    """

    def __init__(self, inner: Runner) -> None:
        self.inner = inner
        self.block_size, self.vocab_size = inner.block_size, inner.vocab_size
        self.gate = threading.Event()
        self.gate.set()
        self.in_decode = threading.Event()

    def bytes_per_slot(self) -> int:
        return self.inner.bytes_per_slot()

    def allocate(self, slots: int) -> None:
        self.inner.allocate(slots)
        self.slots = slots

    def prefill(self, prompts: Sequence[Sequence[int]], slots: Sequence[int]) -> torch.Tensor:
        return self.inner.prefill(prompts, slots)

    def close(self) -> None:
        """Hold the next decode step (and every one after) until `open`; `held` says when one waits."""
        self.in_decode.clear()
        self.gate.clear()

    def open(self) -> None:
        self.gate.set()

    def held(self) -> bool:
        return self.in_decode.is_set() and not self.gate.is_set()

    def decode(self, tokens: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        self.in_decode.set()
        if not self.gate.wait(BOUND):
            raise TimeoutError("the test never opened the gate")
        return self.inner.decode(tokens, lengths)

    def move(self, src: int, dst: int, length: int) -> None:
        self.inner.move(src, dst, length)


def served_lm(name: str, model: GPT, tokenizer: ByteTokenizer | None = ByteTokenizer(), **options: Any) -> ServedModel:
    """``model`` served for logits and generation; its engine decodes through a `GatedRunner`."""
    served = ServedModel.from_module(name, model, (-1,), max_shape=(model.block_size,))
    served.generator = lambda: GenerationEngine(GatedRunner(runner_for(model)), tokenizer, name=name, **options)
    return served


def echo() -> ServedModel:
    spec = [TensorSpec("input", "FP32", (-1, 2))]
    return ServedModel("echo", lambda x: x.clone(), spec, [TensorSpec("output", "FP32", (-1, 2))])


def greedy(model: GPT, prompt: Sequence[int], n: int) -> list[int]:
    """The model's own greedy continuation of ``prompt`` alone (no KV cache: the whole context each step)."""
    with torch.inference_mode():
        return model.generate(torch.tensor([list(prompt)]), n, temperature=0)[0, len(prompt):].tolist()


def sse(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a Server-Sent Events body (each ``data: {json}`` and a blank line)."""
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks = response.text.split("\n\n")
    assert chunks[-1] == "" and all(c.startswith("data: ") for c in chunks[:-1]), response.text
    return [json.loads(c[len("data: "):]) for c in chunks[:-1]]


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def stop_engines(app: Any) -> None:
    for engine in app.state.engines.values():
        await engine.astop()


# --------------------------------------------------------------------------- answers


def test_greedy_answer_equals_the_models_own_generate(checkpoint: str, reference: GPT) -> None:
    """The trained checkpoint in float64 (a copy, served through `engine_factory` as loading builds it):
    ids and text equal ``GPT.generate(..., temperature=0)`` on the prompt alone."""
    model = build_model("gpt", **torch.load(checkpoint, weights_only=True)["model_spec"]["kwargs"])
    model.load_state_dict(reference.state_dict())
    model = model.double().eval()
    served = ServedModel.from_module("gpt", model, (-1,), max_shape=(BLOCK,))
    served.generator = engine_factory("gpt", LanguageModel(model, BLOCK, ByteTokenizer()), {})
    prompt = "import json"
    want = greedy(model, list(prompt.encode()), 12)
    with TestClient(create_app([served])) as client:
        r = client.post("/v2/models/gpt/generate",
                        json={"text_input": prompt, "parameters": {"max_tokens": 12, "temperature": 0}, "id": "a1"})
    assert r.status_code == 200, r.text
    assert r.json() == {"model_name": "gpt", "model_version": "1", "id": "a1", "text_output": bytes(want).decode(errors="replace"),
                        "output_ids": want, "finish_reason": "length",
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": 12}}


def test_checkpoint_is_served_for_generation_as_partrain_serve_loads_it(checkpoint: str, reference: GPT) -> None:
    """``load_model_spec`` of a GPT checkpoint: a generator with its byte tokenizer, metadata saying so,
    and float32 answers that are the model's greedy choice at every step (up to float32 rounding:
    the cached and uncached passes add in different orders)."""
    served = load_model_spec(f"gpt={checkpoint}", max_queue=7, generation={"max_running": 4})
    assert served.generator is not None
    torch.set_num_threads(1)
    with TestClient(create_app([served])) as client:
        assert client.get("/v2").json()["extensions"] == ["binary_tensor_data", "classification", "generate"]
        meta = client.get("/v2/models/gpt").json()
        assert meta["parameters"]["generate"] == {"max_running": 4, "block_size": BLOCK, "vocab_size": 256,
                                                  "tokenizer": "bytes"}
        assert client.get("/v2/models/gpt/ready").json() == {"name": "gpt", "ready": True}
        engine = client.app.state.engines["gpt"]
        assert (engine.max_queue, engine.running) == (7, True)
        prompt = list(b"class Formatter:")
        r = client.post("/v2/models/gpt/versions/1/generate", json={"input_ids": prompt, "max_tokens": 10,
                                                                     "temperature": 0})
    assert r.status_code == 200, r.text
    got = r.json()["output_ids"]
    assert len(got) == 10 and r.json()["text_output"] == bytes(got).decode("utf-8", errors="replace")
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + got]))[0, len(prompt) - 1:-1]  # the prediction of each new token
    for step, token in enumerate(got):
        assert logits[step, token] >= logits[step].max() - 1e-4, f"step {step}: not the most likely token"
    assert not engine.running  # the lifespan stopped it


def test_concurrent_requests_share_decode_steps_and_get_their_own_answers(varied: GPT) -> None:
    """Six prompts of different lengths and max_tokens: the first holds its slot (gate closed) while the
    other five queue, so all six then run in the same steps; each answer is the model's on its own."""
    app = create_app([served_lm("v", varied, max_running=8)])
    prompts = ["def f", "import json", "class Formatter:", "x", "hello world", "for i in range(3):"]
    lengths = [12, 5, 9, 20, 2, 14]

    async def run() -> list[httpx.Response]:
        async with client_for(app) as c:
            def post(i: int) -> asyncio.Task:
                body = {"text_input": prompts[i], "parameters": {"max_tokens": lengths[i], "temperature": 0}}
                return asyncio.ensure_future(c.post("/v2/models/v/generate", json=body))

            engine = app.state.engines["v"]
            engine.runner.close()
            first = post(0)
            await async_wait_until(engine.runner.held, "the first request holding its slot")
            rest = [post(i) for i in range(1, len(prompts))]
            await async_wait_until(lambda: engine.queue_depth == len(prompts) - 1, "the other five queued")
            engine.runner.open()
            answers = await asyncio.gather(first, *rest)
            await stop_engines(app)
            return answers

    answers = asyncio.run(run())
    engine = app.state.engines["v"]
    assert engine.stats.peak_running == len(prompts)  # they ran together
    for p, n, r in zip(prompts, lengths, answers):
        assert r.status_code == 200, r.text
        want = greedy(varied, list(p.encode()), n)
        assert (r.json()["output_ids"], r.json()["text_output"]) == (want, bytes(want).decode())
        assert r.json()["usage"] == {"prompt_tokens": len(p), "completion_tokens": n}


def test_a_request_that_ends_at_its_prefill_leaves_the_others_running(varied: GPT) -> None:
    """max_tokens 1 ends a request with the token its prefill chose, in a step where another sequence
    decodes: the finished one must leave before that decode step (it has no next token to feed)."""
    app = create_app([served_lm("v", varied)])

    async def run() -> list[httpx.Response]:
        async with client_for(app) as c:
            engine = app.state.engines["v"]
            engine.runner.close()
            long = asyncio.ensure_future(c.post("/v2/models/v/generate", json={"text_input": "def f", "max_tokens": 6,
                                                                               "temperature": 0}))
            await async_wait_until(engine.runner.held, "the long request holding its slot")
            short = asyncio.ensure_future(c.post("/v2/models/v/generate", json={"text_input": "x", "max_tokens": 1,
                                                                                "temperature": 0}))
            await async_wait_until(lambda: engine.queue_depth == 1, "the short request queued")
            engine.runner.open()
            answers = await asyncio.gather(long, short)
            await stop_engines(app)
            return answers

    long, short = asyncio.run(run())
    assert long.status_code == 200 and short.status_code == 200, (long.text, short.text)
    assert long.json()["output_ids"] == greedy(varied, list(b"def f"), 6)
    assert short.json()["output_ids"] == greedy(varied, list(b"x"), 1)


def test_stream_adds_up_to_the_one_shot_answer(varied: GPT) -> None:
    """One event per token (and text as it becomes final), the last with finish_reason and usage; the
    pieces concatenated equal /generate's answer."""
    body = {"text_input": "hello world", "max_tokens": 9, "temperature": 0, "id": "s"}
    with TestClient(create_app([served_lm("v", varied)])) as client:
        whole = client.post("/v2/models/v/generate", json=body).json()
        r = client.post("/v2/models/v/generate_stream", json=body)
    assert r.status_code == 200, r.text
    events = sse(r)
    assert len(events) == 9 and all(len(e["output_ids"]) == 1 for e in events)
    assert [e["finish_reason"] for e in events] == [None] * 8 + ["length"]
    assert all(e["model_name"] == "v" and e["model_version"] == "1" and e["id"] == "s" for e in events)
    assert ["usage" in e for e in events] == [False] * 8 + [True]
    assert sum((e["output_ids"] for e in events), []) == whole["output_ids"] == greedy(varied, list(b"hello world"), 9)
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    assert events[-1]["usage"] == whole["usage"] == {"prompt_tokens": 11, "completion_tokens": 9}


def test_seeded_sampling_is_the_same_whatever_else_runs(varied: GPT) -> None:
    """A seeded request alone, then again sharing every step with four others (two sampling unseeded):
    the same tokens. The blocker holds its slot until all five are queued, so they share steps."""
    seeded = {"text_input": "def f", "max_tokens": 12, "temperature": 1.5, "top_k": 40, "top_p": 0.95, "seed": 7}
    others = [{"text_input": "x", "max_tokens": 8, "temperature": 2.0},
              {"input_ids": [5, 6, 7], "max_tokens": 12, "temperature": 0},
              {"text_input": "import", "max_tokens": 15, "temperature": 1.0, "top_k": 3}]
    app = create_app([served_lm("v", varied)])

    async def run() -> tuple[list[int], list[int]]:
        async with client_for(app) as c:
            alone = (await c.post("/v2/models/v/generate", json=seeded)).json()["output_ids"]
            engine = app.state.engines["v"]
            engine.runner.close()
            blocker = asyncio.ensure_future(c.post("/v2/models/v/generate", json={"text_input": "y", "max_tokens": 10}))
            await async_wait_until(engine.runner.held, "the blocker holding its slot")
            crowd = [asyncio.ensure_future(c.post("/v2/models/v/generate", json=b)) for b in [seeded, *others]]
            await async_wait_until(lambda: engine.queue_depth == 4, "the others queued")
            engine.runner.open()
            answers = await asyncio.gather(blocker, *crowd)
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            await stop_engines(app)
            return alone, answers[1].json()["output_ids"]

    alone, crowded = asyncio.run(run())
    assert app.state.engines["v"].stats.peak_running == 5
    assert alone == crowded and len(alone) == 12


def test_stop_strings_and_stop_token_ids_end_the_answer(varied: GPT) -> None:
    """A stop string ends the text before it (finish_reason "stop"), in the stream too; a stop token id
    ends the ids before it."""
    prompt = "hello world"
    ids = greedy(varied, list(prompt.encode()), 14)
    text = bytes(ids).decode()
    stop = text[5:7]
    cut = text.find(stop)
    assert cut > 0  # the continuation has text before the stop string: the test below means something
    with TestClient(create_app([served_lm("v", varied)])) as client:
        for route in ("generate", "generate_stream"):
            r = client.post(f"/v2/models/v/{route}", json={"text_input": prompt, "max_tokens": 14, "temperature": 0,
                                                           "parameters": {"stop": ["never", stop]}})
            events = sse(r) if route == "generate_stream" else [r.json()]
            assert "".join(e["text_output"] for e in events) == text[:cut], route
            assert events[-1]["finish_reason"] == "stop"
        r = client.post("/v2/models/v/generate", json={"text_input": prompt, "max_tokens": 14, "temperature": 0,
                                                       "stop_token_ids": [ids[3]]})
    first = ids.index(ids[3])
    assert (r.json()["output_ids"], r.json()["finish_reason"]) == (ids[:first], "stop")


# --------------------------------------------------------------------------- refusals


def _engine_line(engine: GenerationEngine, prompt: list[int], **params: Any) -> str:
    with pytest.raises(RequestError) as info:
        engine.check(prompt, SamplingParams(**params))
    return str(info.value)


BAD = [
    ("v", {"text_input": "ab", "max_tokens": BLOCK}, None),
    ("v", {"input_ids": [1] * BLOCK}, None),
    ("v", {"text_input": ""}, None),
    ("v", {"input_ids": [1, 300]}, None),
    ("v", {"text_input": "a", "max_tokens": 0}, "Expected max_tokens as an integer >= 1. Received: max_tokens=0"),
    ("v", {"text_input": "a", "temprature": 1}, "Received: 'temprature'"),
    ("v", {"text_input": "a", "parameters": {"top_q": 1}}, "Received: 'top_q'"),
    ("v", {"text_input": "a", "max_tokens": 2, "parameters": {"max_tokens": 3}},
     "Expected each generation parameter once, at the top level or in parameters. Received: 'max_tokens' in both"),
    ("v", {"text_input": "a", "input_ids": [1]}, "Received: both"),
    ("v", {"parameters": {}}, "Received: neither"),
    ("v", {"input_ids": "abc"}, "Expected input_ids as a list of token ids. Received: input_ids='abc'"),
    ("v", {"text_input": "a", "id": 5}, "Expected id as a string. Received: id=5"),
    ("v", [1, 2], "Received: a JSON list"),
    ("v", "{not json", "Received invalid JSON"),
    ("ids", {"text_input": "a"}, "Expected input_ids for model 'ids': it has no tokenizer to read text with. "
                                 "Received: text_input"),
    ("ids", {"input_ids": [1], "stop": "x"}, "Expected no stop strings for model 'ids'"),
]


@pytest.mark.parametrize(("model", "body", "line"), BAD, ids=[
    "max-tokens-past-context", "prompt-fills-context", "empty-prompt", "id-out-of-vocabulary", "max-tokens-0",
    "unknown-key", "unknown-parameter", "parameter-twice", "text-and-ids", "no-prompt", "ids-not-a-list",
    "id-not-a-string", "not-an-object", "bad-json", "text-without-tokenizer", "stop-without-tokenizer"])
def test_bad_requests_are_one_line_400_before_anything_runs(varied: GPT, model: str, body: Any,
                                                            line: str | None) -> None:
    """Both routes: 400 with one line (the stream never starts); the engine never saw the request.
    Where the engine's own check refuses, the line is its line."""
    ids_only = GPT(vocab_size=64, n_layer=1, n_head=2, n_embd=8, block_size=BLOCK).eval()
    app = create_app([served_lm("v", varied), served_lm("ids", ids_only, tokenizer=None)])
    with TestClient(app) as client:
        engine = app.state.engines[model]
        if line is None:  # the engine's own refusal of this prompt
            params = {k: v for k, v in body.items() if k in SamplingParams.KEYS}
            prompt = body.get("input_ids") or list(body.get("text_input", "").encode())
            line = _engine_line(engine, prompt, **params)
        for route in ("generate", "generate_stream"):
            content = body if isinstance(body, str) else json.dumps(body)
            r = client.post(f"/v2/models/{model}/{route}", content=content)
            assert r.status_code == 400 and r.headers["content-type"] == "application/json", (route, r.text)
            error = r.json()["error"]
            assert "\n" not in error and error.startswith("Expected") and "Received" in error, error
            assert line in error, (route, error)
        assert engine.stats.finished == 0 and engine.stats.prefills == 0


def test_models_that_do_not_generate_are_404_and_the_token_guards_generation(varied: GPT) -> None:
    app = create_app([served_lm("v", varied), echo()], token="s3cret")
    auth = {"Authorization": "Bearer s3cret"}
    with TestClient(app) as client:
        for route in ("generate", "generate_stream"):
            r = client.post(f"/v2/models/echo/{route}", json={"input_ids": [1]}, headers=auth)
            assert r.status_code == 404 and r.json() == {
                "error": "Expected a model that generates, among ['v']. Received: 'echo' (it answers infer only)"}
            r = client.post(f"/v2/models/v/{route}", json={"input_ids": [1]})
            assert r.status_code == 401
            r = client.post(f"/v2/models/v/versions/2/{route}", json={"input_ids": [1]}, headers=auth)
            assert r.status_code == 404 and "Expected version '1'" in r.json()["error"]
        assert client.post("/v2/models/v/generate", json={"input_ids": [1], "max_tokens": 2},
                           headers=auth).status_code == 200
        assert "extensions" in client.get("/v2", headers=auth).json()


def test_queue_full_is_503_with_retry_after(varied: GPT) -> None:
    """One slot, one place in the queue: the first request holds the slot (gate closed), the second
    waits, the third is refused on both routes; the first two are answered once the gate opens."""
    app = create_app([served_lm("v", varied, max_running=1, max_queue=1)])
    body = {"text_input": "abc", "max_tokens": 3}

    async def run() -> None:
        async with client_for(app) as c:
            engine = app.state.engines["v"]
            engine.runner.close()
            first = asyncio.ensure_future(c.post("/v2/models/v/generate", json=body))
            await async_wait_until(engine.runner.held, "the first request holding its slot")
            second = asyncio.ensure_future(c.post("/v2/models/v/generate_stream", json=body))
            await async_wait_until(lambda: engine.queue_depth == 1, "the second request queued")
            for route in ("generate", "generate_stream"):
                r = await c.post(f"/v2/models/v/{route}", json=body)
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert r.json()["error"].startswith("Expected at most 1 requests waiting for model 'v'")
            engine.runner.open()
            assert (await first).status_code == 200
            assert sse(await second)[-1]["finish_reason"] == "length"
            await stop_engines(app)

    asyncio.run(run())


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_a_client_that_disconnects_frees_its_slot(varied: GPT, route: str) -> None:
    """The ASGI app driven directly: the body, then ``http.disconnect`` once the request holds its slot
    (its first decode step waits at the closed gate). The handler cancels it; when the step ends the
    engine frees the slot after 2 of the 20 tokens asked for."""
    app = create_app([served_lm("v", varied)])
    body = json.dumps({"text_input": "abc", "max_tokens": 20}).encode()

    async def run() -> list[dict[str, Any]]:
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        path = f"/v2/models/v/{route}"
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "headers": [(b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("test", 80)}
        engine = app.state.engines["v"]
        engine.runner.close()
        call = asyncio.ensure_future(app(scope, receive, send))
        await async_wait_until(engine.runner.held, "the request holding its slot (its first decode step waits)")
        gone.set()
        await asyncio.wait_for(call, BOUND)  # the handler noticed and returned
        assert engine.active == 1  # still in the step: the slot frees when it ends
        engine.runner.open()
        await async_wait_until(lambda: engine.active == 0 and engine.queue_depth == 0 and engine.stats.finished == 1,
                               "the slot freed")
        await stop_engines(app)
        return sent

    asyncio.run(run())
    engine = app.state.engines["v"]
    assert engine.stats.generated <= 2  # the prefill's token and the step's that was running: no more


# --------------------------------------------------------------------------- metrics, loading, CLI


def test_metrics_count_requests_tokens_and_steps(varied: GPT) -> None:
    with TestClient(create_app([served_lm("v", varied)])) as client:
        assert client.post("/v2/models/v/generate", json={"text_input": "ab", "max_tokens": 4}).status_code == 200
        assert client.post("/v2/models/v/generate_stream", json={"text_input": "cd", "max_tokens": 3}).status_code == 200
        assert client.post("/v2/models/v/generate", json={"text_input": "ab", "max_tokens": 99}).status_code == 400
        engine = client.app.state.engines["v"]
        text = client.get("/metrics").text
    samples = {(s.name, s.labels.get("code"), s.labels.get("le")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples
               if s.labels.get("model") == "v"}
    assert samples[("partrain_generate_requests_total", None, None)] == 3
    assert samples[("partrain_generate_errors_total", "400", None)] == 1
    assert samples[("partrain_generated_tokens_total", None, None)] == 7
    assert samples[("partrain_time_to_first_token_seconds_count", None, None)] == 2
    assert samples[("partrain_decode_step_seconds_count", None, None)] == engine.stats.steps > 0
    assert samples[("partrain_decode_batch_size_sum", None, None)] == engine.stats.decoded_rows
    assert samples[("partrain_generate_running", None, None)] == 0
    assert samples[("partrain_generate_waiting", None, None)] == 0


def test_factory_gpt_generates_and_infers_up_to_its_block(tmp_path) -> None:
    """A ``module:factory`` returning the built-in GPT gets a generator, and its infer route the block as
    its longest input (before, a longer prompt reached the model)."""
    served = load_model_spec("g=tests.serve.test_generate_http:small_gpt")
    assert served.generator is not None
    assert served.inputs[0].max_shape == (-1, BLOCK)
    engine = served.generator()
    assert engine.tokenizer is not None and engine.tokenizer.name == "bytes"
    with pytest.raises(UsageError, match=r"^Expected a KV cache budget of at least one sequence"):
        engine_factory("g", LanguageModel(small_gpt(), BLOCK, None), {"cache_bytes": 10})


def small_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, n_layer=1, n_head=2, n_embd=8, block_size=BLOCK).eval()


def test_partrain_serve_options_and_start_line(monkeypatch, capsys) -> None:
    from partrain.serve import cli as serve_cli

    seen: dict[str, Any] = {}

    def fake_run_server(make_models, *, announce, **kw) -> int:
        seen["engine"] = make_models()[0].generator()
        announce("http://127.0.0.1:8123")
        return 0

    monkeypatch.setattr(serve_cli, "run_server", fake_run_server)
    assert main(["serve", "g=tests.serve.test_generate_http:small_gpt", "--max-running", "3", "--kv-cache-mb", "2",
                 "--max-prefill-tokens", "64", "--max-queue", "5"]) == 0
    url = "http://127.0.0.1:8123/v2/models/g"
    assert capsys.readouterr().out.splitlines() == [
        f"partrain serve: serving model 'g' at {url}/infer and {url}/generate (also generate_stream)"]
    engine = seen["engine"]
    assert (engine.max_running, engine.max_queue, engine.max_prefill_tokens) == (3, 5, 64)
    for flag in ("--max-running", "--kv-cache-mb", "--max-prefill-tokens"):
        assert main(["serve", "x.pt", flag, "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"Expected {flag} >= 1. Received: {flag}=0" in err, err


# --------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str, str]:
    """A tiny random GPT-2 (float64, weights scaled up so that greedy continuations vary) saved twice:
    with a byte-level BPE tokenizer trained here (nothing downloads), and alone (token ids only)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["def f(x):\n    return x + 1\n", "import json\nclass Formatter:\n    pass\n"] * 4, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=BLOCK, n_embd=16, n_layer=2, n_head=2,
                                     eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8)
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "ids")
    model.save_pretrained(root / "text")
    tokenizer.save_pretrained(root / "text")
    return model, str(root / "ids"), str(root / "text")


def hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], str]:
    """Hugging Face's own ``generate`` (greedy) on the prompt alone: the new ids without a final end-of-text
    id, and the finish reason that implies."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             pad_token_id=model.config.eos_token_id)[0, len(prompt):].tolist()
    eos = model.config.eos_token_id
    return (out[:out.index(eos)], "stop") if eos in out else (out, "length")


def test_hugging_face_causal_lm_directory_answers_as_its_own_generate(hf_dirs) -> None:
    """``partrain serve lm=DIR`` of a ``save_pretrained`` GPT-2 without a tokenizer: token ids in and out,
    greedy ids equal to ``model.generate(do_sample=False)``; the infer route serves its logits."""
    model, ids_dir, _ = hf_dirs
    served = load_model_spec(f"lm={ids_dir}")
    assert served.generator is not None
    prompts = [[3, 14, 15, 9, 2, 6], [5, 3], [27, 18, 28, 1, 8, 2, 8, 4, 5]]
    with TestClient(create_app([served])) as client:
        assert client.get("/v2/models/lm").json()["parameters"]["generate"]["tokenizer"] is None
        for prompt in prompts:
            r = client.post("/v2/models/lm/generate", json={"input_ids": prompt, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            want, reason = hf_greedy(model, prompt, 12)
            assert (r.json()["output_ids"], r.json()["finish_reason"]) == (want, reason)
            assert "text_output" not in r.json()
        r = client.post("/v2/models/lm/generate", json={"text_input": "x"})
        assert r.status_code == 400 and "it has no tokenizer" in r.json()["error"]
        r = client.post("/v2/models/lm/infer", json={"inputs": [{"name": "input", "datatype": "INT64",
                                                                 "shape": [1, 6], "data": prompts[0]}]})
        assert r.status_code == 200, r.text
        out = r.json()["outputs"][0]
    assert (out["datatype"], out["shape"]) == ("FP32", [1, 6, model.config.vocab_size])
    with torch.inference_mode():
        logits = model(torch.tensor([prompts[0]])).logits.float()
    torch.testing.assert_close(torch.tensor(out["data"]).view(logits.shape), logits)
    assert served.inputs[0].max_shape == (-1, BLOCK)


def test_hugging_face_directory_with_its_tokenizer_answers_text(hf_dirs) -> None:
    model, _, text_dir = hf_dirs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_dir, local_files_only=True)
    served = load_model_spec(f"lm={text_dir}")
    prompt = "def f(x):"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    want, reason = hf_greedy(model, ids, 10)
    with TestClient(create_app([served])) as client:
        assert client.get("/v2/models/lm").json()["parameters"]["generate"]["tokenizer"] == text_dir
        answer = client.post("/v2/models/lm/generate", json={"text_input": prompt, "max_tokens": 10,
                                                              "temperature": 0}).json()
        events = sse(client.post("/v2/models/lm/generate_stream", json={"text_input": prompt, "max_tokens": 10,
                                                                         "temperature": 0}))
    assert (answer["output_ids"], answer["finish_reason"]) == (want, reason)
    assert answer["text_output"] == tokenizer.decode(want, skip_special_tokens=True)
    assert "".join(e["text_output"] for e in events) == answer["text_output"]
    assert answer["usage"]["prompt_tokens"] == len(ids)


def test_directories_that_hold_no_causal_lm_are_one_line(tmp_path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(UsageError, match=r"^Expected a directory holding a Hugging Face causal language model "
                                         r".*Received: '.*' without config\.json$"):
        load_model_spec(f"lm={tmp_path}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(UsageError, match=r"^Expected a Hugging Face causal language model in .* Received: ") as info:
        load_model_spec(f"lm={tmp_path}")
    assert "\n" not in str(info.value)
