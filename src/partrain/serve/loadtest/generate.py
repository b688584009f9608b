"""``partrain loadtest --generate``: load a generative model's ``/generate_stream`` and time every token.

A generate request is tens to hundreds of decode steps, so its latency alone says
little; what a user feels is the *time to first token* (TTFT: from the send, or in
open loop from the scheduled arrival, to the first event that carries a token) and
the *time per output token* after it (TPOT: ``(last token's time - first token's
time) / (tokens - 1)``, per request). Each request goes to the Server-Sent Events
route, so both are read off the events as they arrive.

Vocabulary:

- *prompt*: one entry of the pool that requests cycle through (`Prompt`): token ids
  drawn from the model's vocabulary, or a line of text, and its ``max_tokens``;
- *event*: one ``data: {json}`` of the stream, with the time its bytes arrived.

The closed and open loops, the HTTP connections and the per-request bookkeeping are
the infer load's (`runner.drive`, `client`, `runner.Recorder`); this module adds the
prompts, the stream reading and the token figures (`report.GenerateReport`), and
greedy answers are checked against the model alone (`checking.GreedyChecker`).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import UsageError
from .checking import GreedyChecker, load_reference_model
from .client import ConnectionPool
from .config import LoadConfig, parse_target
from .report import GenerateReport
from .runner import Recorder, drive, exchange
from .target import ModelInfo, query_model_info

DEFAULT_PROMPT_TOKENS = (16, 128)
DEFAULT_MAX_TOKENS = (16, 256)


@dataclass(frozen=True)
class GenerateSettings:
    """What the generate requests ask for (beside `LoadConfig`'s how many and how fast).

    ``prompt_tokens`` and ``max_tokens`` are inclusive ranges drawn uniformly per
    prompt; ``prompts_file`` replaces the random ids by lines of text. ``ignore_eos``
    None: on for random ids (so that lengths are what was asked), off for text.
    """

    prompt_tokens: tuple[int, int] = DEFAULT_PROMPT_TOKENS
    max_tokens: tuple[int, int] = DEFAULT_MAX_TOKENS
    prompts_file: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool | None = None

    def validate(self) -> None:
        for name in ("prompt_tokens", "max_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise UsageError(f"Expected --{name.replace('_', '-')} LOW:HIGH with 1 <= LOW <= HIGH. "
                                 f"Received: {low}:{high}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise UsageError(f"Expected a temperature >= 0 (0: greedy). Received: {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"Expected --top-p in (0, 1]. Received: {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"Expected --top-k >= 0 (0: off). Received: {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def ignores_eos(self) -> bool:
        return self.ignore_eos if self.ignore_eos is not None else self.prompts_file is None


@dataclass(frozen=True)
class GenerativeModel:
    """What the metadata says about a generative model: token ids in ``[low, high)``, its context."""

    name: str
    vocab: tuple[int, int]
    block_size: int
    tokenizer: str | None = None


def generative_model(info: ModelInfo) -> GenerativeModel:
    """Read ``parameters.generate`` (and the token ids' ``value_range``) from the model's metadata."""
    gen = info.parameters.get("generate")
    if not isinstance(gen, dict):
        raise UsageError(f"Expected a generative model (metadata with parameters.generate) for --generate. "
                         f"Received: model {info.name!r} without it (it answers infer only)")
    block = gen.get("block_size")
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise UsageError(f"Expected parameters.generate.block_size >= 2 in the metadata of model {info.name!r}. "
                         f"Received: {block!r}")
    vocab = None
    for limits in (info.parameters.get("input_limits") or {}).values():
        if isinstance(limits, dict) and isinstance(limits.get("value_range"), list):
            low, high = limits["value_range"]
            vocab = (int(low), int(high))
            break
    if vocab is None and isinstance(gen.get("vocab_size"), int):
        vocab = (0, gen["vocab_size"])
    if vocab is None or vocab[1] <= vocab[0]:
        raise UsageError(f"Expected the token ids model {info.name!r} takes in its metadata "
                         f"(parameters.input_limits value_range). Received: {vocab!r}")
    tokenizer = gen.get("tokenizer")
    return GenerativeModel(info.name, vocab, block, tokenizer if isinstance(tokenizer, str) else None)


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    """One prompt of the pool: token ids or text, its length in tokens, and its ``max_tokens``.

    ``ids`` is what the check feeds the local model (for text, the local tokenizer's
    ids; None when it is not available here). ``length`` is the prompt's tokens, for
    text without a local tokenizer its UTF-8 bytes (an upper bound for byte-level
    tokenizers), used only to fit ``max_tokens`` into the context.
    """

    ids: tuple[int, ...] | None
    text: str | None
    length: int
    max_tokens: int
    seed: int = 0


def _max_tokens(rng: np.random.Generator, limits: tuple[int, int], room: int) -> int:
    """A length drawn from ``limits``, capped to the ``room`` the context leaves (at least 1)."""
    return max(1, min(int(rng.integers(limits[0], limits[1] + 1)), room))


def random_prompts(model: GenerativeModel, settings: GenerateSettings, count: int, seed: int = 0) -> list[Prompt]:
    """``count`` prompts of random token ids: lengths uniform in ``settings.prompt_tokens`` (below the
    context), ``max_tokens`` uniform in ``settings.max_tokens`` capped so prompt + answer fit."""
    low, high = settings.prompt_tokens
    if low >= model.block_size:
        raise UsageError(f"Expected prompts shorter than the context of model {model.name!r}, {model.block_size} "
                         f"tokens. Received: --prompt-tokens {low}:{high}")
    high = min(high, model.block_size - 1)
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(count):
        length = int(rng.integers(low, high + 1))
        ids = tuple(int(t) for t in rng.integers(model.vocab[0], model.vocab[1], size=length))
        prompts.append(Prompt(ids, None, length, _max_tokens(rng, settings.max_tokens, model.block_size - length),
                              seed + i))
    return prompts


def file_prompts(path: str, model: GenerativeModel, settings: GenerateSettings, seed: int = 0,
                 tokenizer: Any = None) -> list[Prompt]:
    """One prompt per non-empty line of ``path`` (text, sent as ``text_input``), each its own ``max_tokens``."""
    if model.tokenizer is None:
        raise UsageError(f"Expected a model with a tokenizer for text prompts (--prompts). Received: model "
                         f"{model.name!r} takes token ids only (use --prompt-tokens)")
    if not os.path.isfile(path):
        raise UsageError(f"Expected a text file of prompts, one per line. Received: {path!r} (no such file)")
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\r\n") for line in f]
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"Expected a UTF-8 text file of prompts. Received: {path!r} ({exc})") from None
    rng = np.random.default_rng(seed)
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        ids = tuple(tokenizer.encode(line)) if tokenizer is not None else None
        length = len(ids) if ids is not None else len(line.encode("utf-8"))
        if ids is not None and (not ids or length >= model.block_size):
            raise UsageError(f"Expected prompts of 1 to {model.block_size - 1} tokens (the context of model "
                             f"{model.name!r}). Received: line {number} of {path!r} with {length}")
        room = max(1, model.block_size - length)
        prompts.append(Prompt(ids, line, length, _max_tokens(rng, settings.max_tokens, room), seed + len(prompts)))
    if not prompts:
        raise UsageError(f"Expected at least one prompt in {path!r}. Received: no non-empty line")
    return prompts


def request_body(prompt: Prompt, settings: GenerateSettings, request_id: str) -> bytes:
    """The JSON body of one generate request (parameters inside ``"parameters"``)."""
    params: dict[str, Any] = {"max_tokens": prompt.max_tokens, "temperature": settings.temperature,
                              "ignore_eos": settings.ignores_eos()}
    if not settings.greedy:
        params.update(top_p=settings.top_p, top_k=settings.top_k, seed=prompt.seed)
    body: dict[str, Any] = {"id": request_id}
    if prompt.text is None:
        body["input_ids"] = list(prompt.ids or ())
    else:
        body["text_input"] = prompt.text
    body["parameters"] = params
    return json.dumps(body, separators=(",", ":")).encode()


def describe(model: GenerativeModel, prompts: Sequence[Prompt], settings: GenerateSettings) -> str:
    """One line: the prompts and lengths sent and how tokens are chosen."""
    lengths = [p.length for p in prompts]
    asked = [p.max_tokens for p in prompts]
    if settings.prompts_file is None:
        what = f"random ids in [{model.vocab[0]}, {model.vocab[1]})"
    else:
        what = f"lines of {settings.prompts_file}" + ("" if prompts[0].ids is not None else " (lengths in bytes)")
    sampling = "greedy" if settings.greedy else (f"sampled at temperature {settings.temperature:g}"
                                                 f"{f', top_p {settings.top_p:g}' if settings.top_p < 1 else ''}"
                                                 f"{f', top_k {settings.top_k}' if settings.top_k else ''}")
    return (f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens ({what}), max_tokens "
            f"{min(asked)}-{max(asked)} (context {model.block_size}), {sampling}"
            f"{', ignore_eos' if settings.ignores_eos() else ''}")


# --------------------------------------------------------------------------- the stream


class EventStream:
    """Server-Sent Events parsed as their bytes arrive: ``events`` holds ``(arrival time, object)``.

    ``feed(piece)`` takes the body's pieces in order (split anywhere); an event ends at a
    blank line and its ``data:`` lines are its JSON. A piece of text that is not JSON
    becomes the object ``{"malformed": text}``.
    """

    def __init__(self) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._buffer = b""

    def feed(self, piece: bytes, now: float | None = None) -> None:
        t = time.perf_counter() if now is None else now
        self._buffer += piece.replace(b"\r\n", b"\n")
        while b"\n\n" in self._buffer:
            block, self._buffer = self._buffer.split(b"\n\n", 1)
            data = [line[5:].lstrip(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if not data:
                continue  # a comment or a keep-alive
            text = b"\n".join(data)
            try:
                obj = json.loads(text)
            except ValueError:
                obj = None
            self.events.append((t, obj if isinstance(obj, dict) else {"malformed": text[:200].decode("utf-8", "replace")}))

    @property
    def leftover(self) -> bytes:
        """Bytes after the last complete event (must be none once the answer ended)."""
        return self._buffer.strip()


@dataclass
class StreamAnswer:
    """What one stream added up to: tokens, their timing, the finish reason and usage."""

    tokens: list[int]
    finish_reason: str
    usage: dict[str, Any] | None
    ttft: float  # seconds, start to the first event with a token (nan without one)
    tpot: float | None  # seconds per token after the first (None below two tokens)
    answer_id: str | None = None


class StreamError(ValueError):
    """A stream that is not a well-formed answer; ``kind`` is the error kind reported."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


def read_stream(events: Sequence[tuple[float, dict[str, Any]]], start: float, leftover: bytes = b"") -> StreamAnswer:
    """The answer a stream's timed events add up to; `StreamError` when they are not one.

    TTFT is ``start`` to the first event carrying a token; TPOT is the time from that
    event to the last token's, over the tokens after the first.
    """
    tokens: list[int] = []
    token_times: list[tuple[float, int]] = []
    last: dict[str, Any] | None = None
    answer_id = None
    for i, (t, obj) in enumerate(events):
        if "error" in obj:
            raise StreamError("stream error", " ".join(str(obj["error"]).split())[:300])
        if "malformed" in obj:
            raise StreamError("malformed answer", f"event {i} is not JSON: {obj['malformed']!r}")
        if last is not None:
            raise StreamError("malformed answer", f"event {i} follows the event with the finish reason")
        ids = obj.get("output_ids", [])
        if not isinstance(ids, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in ids):
            raise StreamError("malformed answer", f"event {i} has output_ids {str(ids)[:80]} (not token ids)")
        if ids:
            tokens.extend(ids)
            token_times.append((t, len(ids)))
        if isinstance(obj.get("id"), str):
            answer_id = answer_id or obj["id"]
        if obj.get("finish_reason") is not None:
            last = obj
    if last is None:
        raise StreamError("malformed answer", f"the stream ended after {len(events)} events without a finish "
                                              f"reason{f' (left over: {leftover[:80]!r})' if leftover else ''}")
    reason = last["finish_reason"]
    if reason not in ("length", "stop"):
        raise StreamError("malformed answer", f"finish_reason {reason!r} (expected 'length' or 'stop')")
    ttft = token_times[0][0] - start if token_times else float("nan")
    tpot = (token_times[-1][0] - token_times[0][0]) / (len(tokens) - 1) if len(tokens) >= 2 else None
    usage = last.get("usage") if isinstance(last.get("usage"), dict) else None
    return StreamAnswer(tokens, reason, usage, ttft, tpot, answer_id)


def miscount(answer: StreamAnswer, prompt: Prompt, ignore_eos: bool) -> str:
    """'' when the answer has the tokens asked for and its usage agrees; else what is off."""
    n = len(answer.tokens)
    if answer.usage is None:
        return "no usage in the last event"
    if answer.usage.get("completion_tokens") != n:
        return f"usage says {answer.usage.get('completion_tokens')!r} completion tokens, the stream had {n}"
    if prompt.ids is not None and answer.usage.get("prompt_tokens") != len(prompt.ids):
        return f"usage says {answer.usage.get('prompt_tokens')!r} prompt tokens, the prompt had {len(prompt.ids)}"
    if answer.finish_reason == "length" and n != prompt.max_tokens:
        return f"{n} tokens with finish_reason 'length', max_tokens {prompt.max_tokens}"
    if answer.finish_reason == "stop" and ignore_eos:
        return f"finish_reason 'stop' after {n} of {prompt.max_tokens} tokens with ignore_eos and no stop strings"
    if n > prompt.max_tokens:
        return f"{n} tokens, more than max_tokens {prompt.max_tokens}"
    return ""


# --------------------------------------------------------------------------- the run


class _GenerateRecorder(Recorder):
    """`Recorder` plus each answer's token figures; with ``keep`` the answers to check after the run,
    with ``seeded`` the first answer to each prompt (a seeded prompt's repeats must equal it)."""

    def __init__(self, keep: bool, seeded: bool) -> None:
        super().__init__()
        self.keep, self.seeded = keep, seeded
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.miscounted = 0
        self.first_miscounted = ""
        self.generated: list[tuple[int, int, tuple[int, ...]]] = []  # (request, prompt, tokens)
        self.first_answers: dict[int, tuple[int, ...]] = {}  # prompt -> tokens
        self.repeats_differ = 0

    def tokens(self, index: int, entry: int, tokens: tuple[int, ...]) -> None:
        if self.keep:
            self.generated.append((index, entry, tokens))
        if self.seeded:
            self.repeats_differ += int(self.first_answers.setdefault(entry, tokens) != tokens)


async def _send(pool: ConnectionPool, path: str, prompts: Sequence[Prompt], bodies: Sequence[bytes],
                settings: GenerateSettings, index: int, start: float, timeout: float,
                recorder: _GenerateRecorder) -> None:
    entry = index % len(prompts)
    request_id = str(index)
    tail = bodies[entry]  # the body without its opening '{"id":"...",'
    body = b'{"id":"' + request_id.encode() + b'",' + tail
    stream = EventStream()
    answer = await exchange(pool, path, body, {"Content-Type": "application/json"}, index, timeout, recorder,
                            stream.feed)
    if answer is None:
        return
    latency = time.perf_counter() - start
    try:
        got = read_stream(stream.events, start, stream.leftover)
    except StreamError as exc:
        recorder.failed(index, exc.kind, str(exc))
        return
    if got.answer_id is not None and got.answer_id != request_id:
        recorder.id_mismatches += 1
    recorder.answered(index, latency, entry, {}, keep=False)
    if not math.isnan(got.ttft):
        recorder.ttft.append(got.ttft)
    if got.tpot is not None:
        recorder.tpot.append(got.tpot)
    recorder.output_tokens += len(got.tokens)
    if got.usage is not None and isinstance(got.usage.get("prompt_tokens"), int):
        recorder.prompt_tokens += got.usage["prompt_tokens"]
    problem = miscount(got, prompts[entry], settings.ignores_eos())
    if problem:
        recorder.miscounted += 1
        recorder.first_miscounted = recorder.first_miscounted or f"request {index}: {problem}"
    recorder.tokens(index, entry, tuple(got.tokens))


async def run_generate_async(cfg: LoadConfig, settings: GenerateSettings, prompts: Sequence[Prompt],
                             checker: GreedyChecker | None = None, workload: str = "") -> GenerateReport:
    """Run one generate load test over ``prompts`` (see `prepare_generate`) and return what it saw.

    With ``checker`` (greedy runs only), every answer is compared with the model alone
    after the run, so that the reference's work never slows the load.
    """
    cfg.validate()
    settings.validate()
    if not prompts:
        raise UsageError("Expected at least one prompt to send. Received: none")
    if checker is not None and not settings.greedy:
        raise UsageError(f"Expected greedy requests (temperature 0) to check. Received: temperature "
                         f"{settings.temperature:g}")
    if checker is not None and any(p.ids is None for p in prompts):
        raise UsageError("Expected the prompts' token ids to check answers with. Received: text prompts and no "
                         "local tokenizer")
    base, model = parse_target(cfg.url, cfg.model)
    path = f"/v2/models/{model}/generate_stream"
    # each body without its opening brace: '{"id":"<id>",' is prepended per request
    bodies = [request_body(p, settings, "")[len(b'{"id":"",'):] for p in prompts]
    # a seeded request's draws are its own: the same prompt and seed give the same answer
    recorder = _GenerateRecorder(keep=checker is not None, seeded=not settings.greedy)

    async def send(pool: ConnectionPool, index: int, start: float) -> None:
        await _send(pool, path, prompts, bodies, settings, index, start, cfg.timeout, recorder)

    mode, sent, elapsed = await drive(cfg, base, send, recorder)
    report = GenerateReport(mode=mode, elapsed=elapsed, sent=sent, latencies=recorder.latencies,
                            errors=recorder.errors, id_mismatches=recorder.id_mismatches,
                            first_error=recorder.first_error, workload=workload, ttft=recorder.ttft,
                            tpot=recorder.tpot, prompt_tokens=recorder.prompt_tokens,
                            output_tokens=recorder.output_tokens, miscounted=recorder.miscounted,
                            first_miscounted=recorder.first_miscounted,
                            repeats_differ=recorder.repeats_differ)
    report.duplicates = sum(1 for n in recorder.seen.values() if n > 1)
    report.missing = sum(1 for i in range(sent) if i not in recorder.seen)
    if not settings.greedy:
        report.unchecked = f"sampled at temperature {settings.temperature:g}: only greedy answers can be checked"
    if checker is not None:
        check_answers(report, checker, prompts, recorder.generated)
    return report


def check_answers(report: GenerateReport, checker: GreedyChecker, prompts: Sequence[Prompt],
                  generated: Sequence[tuple[int, int, tuple[int, ...]]]) -> None:
    """Compare each ``(request, prompt, tokens)`` with the model alone; count wrong answers and ties."""
    for index, entry, tokens in generated:
        ids = prompts[entry].ids
        assert ids is not None
        verdict, what = checker.compare(ids, tokens)
        report.checked += 1
        where = f"request {index} (prompt {entry}, {len(ids)} tokens)"
        if verdict == "wrong":
            report.wrong += 1
            report.first_wrong = report.first_wrong or f"{where}: {what}"
        elif verdict == "tie":
            report.ties += 1
            report.first_tie = report.first_tie or f"{where}: {what}"


def run_generate(cfg: LoadConfig, settings: GenerateSettings, prompts: Sequence[Prompt],
                 checker: GreedyChecker | None = None, workload: str = "") -> GenerateReport:
    """Blocking `run_generate_async` (starts its own event loop)."""
    return asyncio.run(run_generate_async(cfg, settings, prompts, checker, workload))


def prepare_generate(cfg: LoadConfig, settings: GenerateSettings, check: str | None = None,
                     rtol: float = 1e-4) -> tuple[GenerativeModel, list[Prompt], GreedyChecker | None]:
    """Query the model's metadata, build the prompts and (with ``check``, greedy only) the checker.

    Before the run, so that a bad URL, model, prompt file or check model fails before
    any load is sent.
    """
    cfg.validate()
    settings.validate()
    base, name = parse_target(cfg.url, cfg.model)
    model = generative_model(asyncio.run(query_model_info(base, name, cfg.connect_timeout, cfg.headers)))
    checking = bool(check) and settings.greedy
    if settings.prompts_file is None:
        prompts = random_prompts(model, settings, cfg.samples, cfg.seed)
    else:
        prompts = file_prompts(settings.prompts_file, model, settings, cfg.seed,
                               _local_tokenizer(model, required=checking))
    checker = GreedyChecker(load_reference_model(check), rtol=rtol) if check and checking else None
    return model, prompts, checker


def _local_tokenizer(model: GenerativeModel, required: bool) -> Any:
    """The model's tokenizer loaded here (to count and check text prompts), or None when it cannot be."""
    from ..generation import load_tokenizer

    try:
        return load_tokenizer(model.tokenizer, model.vocab[1])
    except UsageError as exc:
        if required:
            raise UsageError(f"Expected the tokenizer of model {model.name!r} ({model.tokenizer!r}) on this machine "
                             f"to check answers to text prompts. Received: {exc}") from None
        return None
