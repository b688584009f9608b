"""The workload of ``partrain bench generate`` and the alternatives to continuous batching it is measured against.

Vocabulary (as in `partrain.bench.generate`): a *request* is a prompt (token ids) and the
number of tokens to generate for it (``max_tokens``: greedy decoding with end-of-text
ignored, so each runs to exactly that length); a *run* is one variant serving a list of
requests, and yields the tokens it generated, the seconds it took and each request's answer.

The three baselines, each the code a user would otherwise write with the same model:

- `sequential`: one request at a time with a KV cache: prefill the prompt, then one
  token per forward pass (`GPTRunner` with one slot: the engine's own model math);
- `StaticBatching`: request-level batching on the project's `Batcher`: a batch of up to
  ``max_batch`` requests is prefilled together and decoded to its longest ``max_tokens``,
  every row to the end, each caller getting its own length back; requests that arrive
  meanwhile wait for the next batch;
- `hf_sequential`: Hugging Face ``GPT2LMHeadModel.generate`` (its own KV cache), one request
  at a time, on a GPT-2 of the same shape carrying the same weights (`hf_twin`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.gpt import GPT
from ..serve.generation import GPTRunner


@dataclass(frozen=True)
class Request:
    """One generation: its prompt and how many tokens it runs to."""

    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Run:
    """What one variant did with a list of requests: tokens generated, wall seconds, answers by request index."""

    tokens: int
    seconds: float
    answers: dict[int, tuple[int, ...]] = field(default_factory=dict)
    short: int = 0  # answers shorter than their max_tokens (each request must run to its end)
    errors: int = 0  # requests that got no answer (a refusal, a dropped connection)
    first_error: str | None = None  # the first of them, as one line

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def requests_per_s(self) -> float:
        return len(self.answers) / self.seconds if self.seconds > 0 else float("nan")


def make_requests(count: int, prompt_lengths: tuple[int, int], output_lengths: tuple[int, int], vocab_size: int,
                  seed: int = 0) -> list[Request]:
    """``count`` requests with prompt lengths and ``max_tokens`` uniform in the given inclusive ranges
    and prompt tokens uniform over the vocabulary: a fixed list for a given seed."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        length = rng.randint(*prompt_lengths)
        requests.append(Request(tuple(rng.randrange(vocab_size) for _ in range(length)), rng.randint(*output_lengths)))
    return requests


def account(run: Run, requests: Sequence[Request], index: int, answer: Sequence[int]) -> None:
    """Record request ``index``'s answer in ``run`` (and count it short when it stopped early)."""
    run.answers[index] = tuple(answer)
    run.tokens += len(answer)
    run.short += len(answer) < requests[index].max_tokens


# --------------------------------------------------------------------------- one at a time


def greedy_answer(runner: GPTRunner, request: Request, slot: int = 0) -> list[int]:
    """Prefill ``request``'s prompt into ``slot`` and decode it greedily, one token per forward pass."""
    logits = runner.prefill([request.prompt], [slot])
    token = int(logits[0].argmax())
    answer, length = [token], len(request.prompt)
    while len(answer) < request.max_tokens:
        token = int(runner.decode([token], [length])[0].argmax())
        length += 1
        answer.append(token)
    return answer


def sequential(model: GPT, requests: Sequence[Request]) -> Run:
    """The loop a user writes: each request on its own, a KV cache of one sequence, a token per forward."""
    runner = GPTRunner(model)
    runner.allocate(1)
    run = Run(0, 0.0)
    start = time.perf_counter()
    for i, request in enumerate(requests):
        account(run, requests, i, greedy_answer(runner, request))
    run.seconds = time.perf_counter() - start
    return run


# --------------------------------------------------------------------------- request-level batching


class StaticBatching:
    """Request-level batching: the `Batcher` collects up to ``max_batch`` requests, and the batch
    runs until its longest request ends (the others' rows are computed along, then cut).

    A request's input is its prompt ([1, P] ids; ``pad=True`` lets prompts of different lengths
    share a batch) and its ``max_tokens`` travels as the request's payload; ``run_batch`` prefills
    the batch's prompts together into a KV cache and decodes every row for the batch's largest
    ``max_tokens``. Callers on any event loop `generate`; `close` stops the batcher.
    """

    def __init__(self, model: GPT, max_batch: int) -> None:
        from ..batching import Batcher

        self.runner = GPTRunner(model)
        self.runner.allocate(max_batch)
        self.batcher = Batcher(None, run_batch=self._run_batch, max_batch_size=max_batch, pad=True,
                               name="static").start_background()

    def _run_batch(self, batch: list) -> list[list[int]]:  # noqa: ANN001 - the Batcher's Pending
        prompts = [p.inputs[0][0].tolist() for p in batch]
        steps = max(p.payload for p in batch)
        tokens = self.runner.prefill(prompts, list(range(len(batch)))).argmax(dim=-1).tolist()
        answers = [[t] for t in tokens]
        lengths = [len(p) for p in prompts]
        for _ in range(steps - 1):  # every row decodes until the longest request of the batch ends
            tokens = self.runner.decode(tokens, lengths).argmax(dim=-1).tolist()
            lengths = [n + 1 for n in lengths]
            for answer, token in zip(answers, tokens):
                answer.append(token)
        return [answer[:p.payload] for answer, p in zip(answers, batch)]

    async def generate(self, request: Request) -> list[int]:
        x = torch.tensor([request.prompt], dtype=torch.int64)
        return await asyncio.wrap_future(self.batcher.submit_threadsafe(x, payload=request.max_tokens))

    def close(self) -> None:
        self.batcher.stop_background(drain=False)


# --------------------------------------------------------------------------- Hugging Face generate


def hf_twin(model: GPT):  # noqa: ANN201 - transformers is optional: no annotation that imports it
    """Hugging Face ``GPT2LMHeadModel`` of ``model``'s shape carrying its weights (float32, eval).

    The two compute the same function: GPT-2's blocks are partrain's (pre-LayerNorm, fused
    q/k/v in that order, an MLP 4x wide, tied output layer), its ``Conv1D`` layers hold the
    transposes of ``nn.Linear``'s weights, and ``activation_function="gelu"`` is the exact GELU
    ``nn.GELU()`` computes. So the greedy answers of ``generate`` can be checked like the others.
    ``eos_token_id=None``: every request runs to ``max_new_tokens``, as ``ignore_eos`` does here.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    blocks: list[Any] = list(model.blocks)  # partrain's `Block`s (ModuleList items are typed as bare modules)
    attn = blocks[0].attn
    config = GPT2Config(vocab_size=model.vocab_size, n_positions=model.block_size, n_embd=model.tok_emb.embedding_dim,
                        n_layer=len(blocks), n_head=attn.n_head, activation_function="gelu",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
                        pad_token_id=0)
    twin = GPT2LMHeadModel(config).eval()
    t = twin.transformer
    with torch.no_grad():
        t.wte.weight.copy_(model.tok_emb.weight)
        t.wpe.weight.copy_(model.pos_emb.weight)
        t.ln_f.load_state_dict(model.ln_f.state_dict())
        for ours, theirs in zip(blocks, t.h):
            theirs.ln_1.load_state_dict(ours.ln_1.state_dict())
            theirs.ln_2.load_state_dict(ours.ln_2.state_dict())
            for conv, linear in ((theirs.attn.c_attn, ours.attn.qkv), (theirs.attn.c_proj, ours.attn.proj),
                                 (theirs.mlp.c_fc, ours.mlp.fc), (theirs.mlp.c_proj, ours.mlp.proj)):
                conv.weight.copy_(linear.weight.t())  # Conv1D computes x @ W: nn.Linear's weight transposed
                conv.bias.copy_(linear.bias)
    return twin


def hf_sequential(twin, requests: Sequence[Request]) -> Run:  # noqa: ANN001
    """``twin.generate`` on each request in turn, greedy, exactly ``max_tokens`` new tokens each."""
    run = Run(0, 0.0)
    start = time.perf_counter()
    with torch.inference_mode():
        for i, request in enumerate(requests):
            ids = torch.tensor([request.prompt], dtype=torch.int64)
            out = twin.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_tokens,
                                min_new_tokens=request.max_tokens, do_sample=False, pad_token_id=0)
            account(run, requests, i, out[0, ids.shape[1]:].tolist())
    run.seconds = time.perf_counter() - start
    return run
