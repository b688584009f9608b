"""The continuous-batching engine (`partrain.serve.generation`) against the model alone (issue 52).

What it guards: sequences that share decode steps, join mid-way and leave at different
times (their slots compacted, `Runner.move`) must each get exactly the tokens the model
gives that one prompt by itself, with no cache at all (`GPT.generate` reruns the whole
context per token; Hugging Face's own ``generate``); a seeded draw must not depend on what
else runs beside it; a caller that leaves frees its slot; a full queue, a stopped engine,
bad prompts and a failing model are each one clear outcome and never a hang.

Equivalence runs in float64 (and once in float32 with one thread): the batched kernels
then agree with the single-sequence run far below any gap between two logits. Start with
`test_greedy_through_the_batch_equals_the_model_alone`.
"""

from __future__ import annotations

import threading

import pytest
import torch

from partrain.batching import BatcherClosed, QueueFull
from partrain.models.gpt import GPT
from partrain.serve.generation import (
    ByteTokenizer,
    GenerationEngine,
    GPTRunner,
    RequestError,
    SamplingParams,
    choose_tokens,
    runner_for,
)

BLOCK = 64


def tiny_gpt(dtype: torch.dtype = torch.float64, seed: int = 0) -> GPT:
    """A random GPT whose next token depends on the whole context: GPT-2's initialisation
    (std 0.02) leaves attention so weak that a random model's greedy token follows from the
    last token alone, and a wrong cache would go unseen."""
    torch.manual_seed(seed)
    model = GPT(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=BLOCK)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.to(dtype).eval()


def test_the_test_model_reads_its_context() -> None:
    """The same last token after different prefixes gives different continuations."""
    model = tiny_gpt()
    assert alone(model, [3, 9, 100], 8) != alone(model, [250, 17, 100], 8)


def prompts(count: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (count,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def run_together(engine: GenerationEngine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """Submit every request from its own thread at once; their completions in order."""
    out: list = [None] * len(requests)
    errors: list[BaseException] = []

    def go(i: int) -> None:
        try:
            out[i] = engine.generate(*requests[i], timeout=120)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    return out


def alone(model: GPT, prompt: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), n, temperature=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_through_the_batch_equals_the_model_alone(dtype: torch.dtype) -> None:
    """Nine prompts of 1-23 tokens, 5-21 new tokens each, through 3 slots: requests wait,
    join as others leave (out of order: different lengths), and sequences move between
    slots. Each answer equals the model on that prompt alone, without a cache.

    The first decode step waits until all nine are queued (`Gate`), so the slots fill up
    whatever the machine's speed: what shares a step is decided here, not by timing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # float32: one thread, so no kernel splits a sum differently
    try:
        model = tiny_gpt(dtype)
        runner = Gate(model)
        engine = GenerationEngine(runner, max_running=3).start()
        ps = prompts(9)
        lengths = [5 + 2 * i for i in range(9)]
        events: list[list] = [[] for _ in ps]
        finished = [threading.Event() for _ in ps]
        try:
            for i, (p, n) in enumerate(zip(ps, lengths)):
                engine.submit(p, SamplingParams(max_tokens=n, temperature=0),
                              lambda e, i=i: (events[i].append(e), e.finish_reason and finished[i].set()))
            runner.gate.set()
            assert all(f.wait(120) for f in finished)
        finally:
            runner.gate.set()
            engine.stop()
        for p, n, answer in zip(ps, lengths, events):
            assert [e.token for e in answer if e.token is not None] == alone(model, p, n)
            assert answer[-1].finish_reason == "length"
        assert engine.stats.peak_running == 3 and engine.stats.finished == 9
        assert engine.stats.mean_batch > 1  # steps were shared
    finally:
        torch.set_num_threads(threads)


def test_a_prompt_filling_the_context_but_one_gets_one_token() -> None:
    model = tiny_gpt()
    engine = GenerationEngine(GPTRunner(model), max_running=2).start()
    try:
        p = prompts(1, seed=3)[0]
        p = (p * BLOCK)[:BLOCK - 1]
        c = engine.generate(p, SamplingParams(temperature=0))  # default max_tokens: what fits
        assert c.tokens == alone(model, p, 1) and c.finish_reason == "length"
    finally:
        engine.stop()


def test_a_seeded_draw_does_not_depend_on_what_runs_beside_it() -> None:
    model = tiny_gpt()
    engine = GenerationEngine(GPTRunner(model), max_running=4).start()
    try:
        mine = ([5, 6, 7], SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, top_k=50, seed=1234))
        by_itself = engine.generate(*mine).tokens
        others = [(p, SamplingParams(max_tokens=20, temperature=1.3, seed=i)) for i, p in enumerate(prompts(5))]
        crowded = run_together(engine, [others[0], mine, *others[1:]])[1].tokens
        another_seed = engine.generate(mine[0], SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95,
                                                               top_k=50, seed=4321)).tokens
    finally:
        engine.stop()
    assert crowded == by_itself
    assert another_seed != by_itself


def test_choosing_follows_the_distribution_and_its_cuts() -> None:
    """Inverse-transform draws on fixed logits: frequencies match softmax(logits / T) (20,000
    seeded draws, so the check is deterministic); top-k and top-p keep the tokens they name."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.7)
    counts = torch.zeros(4)
    for _ in range(20000):
        counts[choose_tokens(logits, [params], [g])[0]] += 1
    expected = torch.softmax(logits[0] / 0.7, dim=0)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.015)
    top2 = {choose_tokens(logits, [SamplingParams(temperature=5.0, top_k=2)], [g])[0] for _ in range(300)}
    assert top2 == {0, 1}
    # top_p 0.8: token 0 has 0.64 of the mass, 0+1 0.88: the set is {0, 1}
    nucleus = {choose_tokens(logits, [SamplingParams(temperature=1.0, top_p=0.8)], [g])[0] for _ in range(300)}
    assert nucleus == {0, 1}
    greedy_rows = choose_tokens(torch.tensor([[0.0, 3.0], [4.0, 1.0]]), [SamplingParams(temperature=0)] * 2, [None] * 2)
    assert greedy_rows == [1, 0]


class Letters:
    """A tokenizer of one printable character per id (no UTF-8 in the way of the stop logic)."""

    name = "letters"
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 33 for c in text]

    def decode(self, ids) -> str:  # noqa: ANN001
        return "".join(chr(33 + i % 94) for i in ids)


def test_stop_strings_end_the_text_before_them_and_stop_ids_end_the_sequence() -> None:
    """Greedy output of the model alone gives the text; a stop string taken from its middle
    ends the answer right before it, and the streamed pieces never show any of it."""
    model = tiny_gpt()
    tok = Letters()
    engine = GenerationEngine(GPTRunner(model), tok, max_running=2).start()
    try:
        p = [5, 6, 7]
        full = alone(model, p, 40)
        text = tok.decode(full)
        at = next(i for i in range(5, 30) if text.find(text[i:i + 3]) == i)  # first seen there
        stop = text[at:at + 3]
        events = []
        done = threading.Event()
        engine.submit(p, SamplingParams(max_tokens=40, temperature=0, stop=("@never@", stop)),
                      lambda e: (events.append(e), e.finish_reason and done.set()))
        assert done.wait(60)
        assert "".join(e.text for e in events) == text[:at] and events[-1].finish_reason == "stop"
        assert [e.token for e in events] == full[:at + 3]  # the ids up to the one completing the stop string
        stop_id = full[7]
        c = engine.generate(p, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(stop_id,)))
        assert c.tokens == full[:full.index(stop_id)] and c.finish_reason == "stop"
        assert c.text == text[:full.index(stop_id)]
    finally:
        engine.stop()


def test_text_streams_wait_for_whole_characters() -> None:
    """UTF-8 bytes split over tokens come out as whole characters, and the pieces add up to
    the text of all the bytes."""
    from partrain.serve.generation import TextStream

    text = "naïve café → ünïcode ✓ done"
    ids = list(text.encode())
    stream = TextStream(ByteTokenizer())
    pieces = [stream.push(t) for t in ids]
    pieces.append(stream.finish())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    held = TextStream(ByteTokenizer(), stop=("→ ü",))
    out = "".join(held.push(t) for t in ids) + held.finish()
    assert out == "naïve café " and held.stopped


class Gate(GPTRunner):
    """A runner whose decode steps wait until the test opens the gate: what runs is then
    decided by the test, not by timing."""

    def __init__(self, model: GPT) -> None:
        super().__init__(model)
        self.gate = threading.Event()
        self.stepping = threading.Event()

    def decode(self, tokens, lengths):  # noqa: ANN001, ANN201
        self.stepping.set()
        assert self.gate.wait(60), "the test never opened the gate"
        return super().decode(tokens, lengths)


def test_a_cancelled_request_frees_its_slot_for_the_next() -> None:
    model = tiny_gpt()
    runner = Gate(model)
    engine = GenerationEngine(runner, max_running=1, max_queue=1).start()
    try:
        first_events = []
        handle = engine.submit([1, 2, 3], SamplingParams(max_tokens=50, temperature=0), first_events.append)
        assert runner.stepping.wait(60)  # the first holds the only slot, blocked in a decode step
        second = []
        finished = threading.Event()
        engine.submit([4, 5], SamplingParams(max_tokens=3, temperature=0),
                      lambda e: (second.append(e), e.finish_reason and finished.set()))
        with pytest.raises(QueueFull, match="Expected at most 1 requests waiting"):
            engine.submit([6], SamplingParams(max_tokens=3), lambda e: None)
        handle.cancel()
        runner.gate.set()
        assert finished.wait(60)
    finally:
        engine.stop()
    assert first_events[-1].finish_reason == "cancelled"
    assert [e.token for e in second] == alone(model, [4, 5], 3)


def test_stop_drains_accepted_requests_and_refuses_new_ones() -> None:
    model = tiny_gpt()
    engine = GenerationEngine(GPTRunner(model), max_running=2).start()
    results = []
    for p in prompts(4):
        engine.submit(p, SamplingParams(max_tokens=6, temperature=0), results.append)
    engine.stop(drain=True)
    assert sum(e.finish_reason == "length" for e in results) == 4
    with pytest.raises(BatcherClosed):
        engine.submit([1], SamplingParams(), lambda e: None)


def test_a_failing_model_ends_its_sequences_with_the_error_and_serves_the_next() -> None:
    class Flaky(GPTRunner):
        fail = True

        def decode(self, tokens, lengths):  # noqa: ANN001, ANN201
            if self.fail:
                self.fail = False
                raise RuntimeError("out of memory (injected)")
            return super().decode(tokens, lengths)

    model = tiny_gpt()
    engine = GenerationEngine(Flaky(model), max_running=2).start()
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate([1, 2], SamplingParams(max_tokens=5, temperature=0))
        assert engine.generate([1, 2], SamplingParams(max_tokens=5, temperature=0)).tokens == alone(model, [1, 2], 5)
    finally:
        engine.stop()


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ([], SamplingParams(), "Expected a prompt of at least one token. Received: an empty prompt"),
    ([1, 256], SamplingParams(), "Expected token ids in [0, 256) for model 'model'. Received: ids in [1, 256]"),
    ([1] * BLOCK, SamplingParams(), "Expected a prompt shorter than the context of model 'model', 64 tokens"),
    ([1] * 60, SamplingParams(max_tokens=5),
     "Expected prompt + max_tokens <= the context of model 'model', 64 tokens. Received: 60 + 5 = 65"),
])
def test_bad_requests_are_one_line(prompt: list[int], params: SamplingParams, message: str) -> None:
    engine = GenerationEngine(GPTRunner(tiny_gpt()), max_running=1)
    with pytest.raises(RequestError) as info:
        engine.check(prompt, params)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize(("params", "message"), [
    ({"max_tokens": 0}, "Expected max_tokens as an integer >= 1. Received: max_tokens=0"),
    ({"temperature": -1}, "Expected temperature as a number >= 0 (0: greedy). Received: temperature=-1"),
    ({"top_p": 0}, "Expected top_p as a number in (0, 1]. Received: top_p=0"),
    ({"seed": "7"}, "Expected seed as an integer >= 0. Received: seed='7'"),
    ({"stop": [""]}, "Expected stop as a non-empty string or a list"),
    ({"max_token": 5}, "Expected generation parameters among max_tokens, temperature"),
])
def test_bad_parameters_are_one_line(params: dict, message: str) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams.from_json(params)
    assert str(info.value).startswith(message)


def test_the_cache_budget_bounds_the_running_sequences() -> None:
    runner = GPTRunner(tiny_gpt())
    per = runner.bytes_per_slot()
    assert per == 2 * 2 * BLOCK * 32 * 8  # keys and values, 2 layers, 64 positions, width 32, float64
    assert GenerationEngine(runner, max_running=32, cache_bytes=5 * per + 1).max_running == 5
    with pytest.raises(ValueError, match="Expected a KV cache budget of at least one sequence"):
        GenerationEngine(runner, cache_bytes=per - 1)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models_equal_their_own_generate(kind: str) -> None:
    """GPT-2 (learned positions) and Llama (rotary positions, 2 key/value heads for 4 query
    heads) through the engine's slots equal ``model.generate`` on each prompt alone."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=BLOCK, vocab_size=256,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          hidden_size=32, intermediate_size=64, max_position_embeddings=BLOCK,
                                          vocab_size=256, bos_token_id=0, eos_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    model = model.double().eval()
    runner = runner_for(model)
    assert runner.eos_token_ids == (0,)
    engine = GenerationEngine(runner, max_running=3).start()
    try:
        ps = [[t or 1 for t in p] for p in prompts(6, seed=5)]
        lengths = [4 + 3 * i for i in range(6)]
        done = run_together(engine, [(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                                     for p, n in zip(ps, lengths)])
    finally:
        engine.stop()
    for p, n, c in zip(ps, lengths, done):
        ref = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)[0, len(p):].tolist()
        assert c.tokens == ref


def test_a_request_ending_at_its_first_token_leaves_before_the_decode_step() -> None:
    """A request whose prefill already gives its last token (max_tokens 1) joins while another
    runs: it must leave before the step it would have had no token for, and the other goes on."""
    model = tiny_gpt()
    runner = Gate(model)
    engine = GenerationEngine(runner, max_running=4).start()
    try:
        long_events, short_events = [], []
        finished = threading.Event()
        engine.submit([1, 2, 3], SamplingParams(max_tokens=8, temperature=0),
                      lambda e: (long_events.append(e), e.finish_reason and finished.set()))
        assert runner.stepping.wait(60)  # the long one is in its first decode step
        engine.submit([7, 8], SamplingParams(max_tokens=1, temperature=0), short_events.append)
        runner.gate.set()
        assert finished.wait(60)
    finally:
        engine.stop()
    assert [e.token for e in short_events] == alone(model, [7, 8], 1)
    assert [e.token for e in long_events] == alone(model, [1, 2, 3], 8)
    assert long_events[-1].finish_reason == "length"


def test_a_transformers_without_the_per_layer_cache_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before transformers 4.54 the cache kept per-model lists the Hugging Face runner cannot read:
    refused at start with the version, not a failure at the first request."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    class ListCache:  # the old shape: key_cache / value_cache lists, no layers
        def __init__(self, num_hidden_layers: int | None = None) -> None:
            self.key_cache: list = []
            self.value_cache: list = []

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, n_positions=16,
                                                                 vocab_size=32))
    monkeypatch.setattr(transformers, "DynamicCache", ListCache)
    with pytest.raises(TypeError, match=r"^Expected transformers 4.54 or later .*Received: transformers "):
        runner_for(model)
