"""`partrain serve` of a GPT checkpoint: logits over the Open Inference Protocol (issue 50, item 4).

What it guards: a language model trains on blocks of one length, and the checkpoint records
that length as its sample shape; served, it must answer a prompt of any length up to it (not
only the full block), with logits [1, T, vocab] of the prompt's own T, and requests of
different lengths that share a batch (padded at the end: the GPT is causal, so no real
position sees the padding) must each get the answers the model gives that prompt alone.
Ids of the wrong datatype, ids outside the vocabulary and prompts longer than the block are
400s with one line each: checked before the batch, so one bad request never fails the
others batched with it.

The checkpoint is trained here by ``partrain train`` (tiny: width 16, one layer, blocks of
16 bytes, two steps). Start with `test_prompts_of_different_lengths_batched_together_get_their_own_logits`.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from partrain.models import build_model
from partrain.serve import ServedModel, create_app
from partrain.serve.loading import load_model_spec
from partrain.serve.protocol import HEADER, decode_response, encode_request

from .conftest import TestClient, train_tiny_gpt

BLOCK = 16
VOCAB = 256  # byte tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return train_tiny_gpt(tmp_path_factory.mktemp("gpt"), BLOCK)


@pytest.fixture(scope="module")
def reference(checkpoint: str) -> torch.nn.Module:
    """The trained model as its spec builds it, called directly: what every answer must equal."""
    state = torch.load(checkpoint, weights_only=True)
    spec = state["model_spec"]
    assert spec["name"] == "gpt" and spec["input_shape"] == [BLOCK]
    model = build_model("gpt", **spec["kwargs"])
    model.load_state_dict(state["model"])
    return model.eval()


def prompt(text: str) -> torch.Tensor:
    return torch.tensor([list(text.encode())], dtype=torch.int64)


def test_metadata_describes_token_ids_of_any_length_up_to_the_block(checkpoint: str) -> None:
    served = load_model_spec(f"gpt={checkpoint}")
    with TestClient(create_app([served])) as client:
        meta = client.get("/v2/models/gpt").json()
    assert meta["inputs"] == [{"name": "input", "datatype": "INT64", "shape": [-1, -1]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, -1, VOCAB]}]
    assert meta["parameters"]["input_limits"] == {"input": {"max_shape": [-1, BLOCK], "value_range": [0, VOCAB]}}
    assert served.pad  # the example run found the answers unchanged by padding at the end


def test_prompts_of_different_lengths_batched_together_get_their_own_logits(checkpoint: str,
                                                                          reference: torch.nn.Module) -> None:
    """Three prompts (5, 16 and 11 tokens; one as JSON, two binary) sent at once make one batch: the
    batch holds three rows and dispatches when full, so no timing decides what is batched."""
    served = load_model_spec(f"gpt={checkpoint}", max_batch_size=3, policy="fixed:30000")
    app = create_app([served])
    prompts = [prompt("def f"), prompt("class Formatter:"), prompt("import json")]
    assert [p.shape[1] for p in prompts] == [5, BLOCK, 11]

    async def run() -> list[torch.Tensor]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            async def one(i: int, x: torch.Tensor) -> torch.Tensor:
                body, headers = encode_request({"input": x}, binary=i > 0, binary_output=i > 0)
                r = await c.post("/v2/models/gpt/infer", content=body, headers=headers)
                assert r.status_code == 200, r.text
                return decode_response(r.content, r.headers.get(HEADER))["output"]

            try:
                return await asyncio.gather(*(one(i, x) for i, x in enumerate(prompts)))
            finally:
                await app.state.batchers["gpt"].stop()

    outs = asyncio.run(run())
    stats = app.state.batchers["gpt"].stats
    assert (stats.batches, stats.batch_sizes) == (1, {3: 1})  # one padded batch, not one per length
    with torch.inference_mode():
        for x, got in zip(prompts, outs):
            assert got.dtype == torch.float32 and got.shape == (1, x.shape[1], VOCAB)
            torch.testing.assert_close(got, reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("x", "line"), [
    (torch.ones(1, 4), "Expected datatype INT64 for input 'input'. Received: FP32"),
    (torch.tensor([[104, 300, 7]]),
     "Expected input 'input' values in [0, 256) (indices into the model's 256 embeddings, e.g. token ids). "
     "Received: values in [7, 300]"),
    (torch.ones(1, BLOCK + 1, dtype=torch.int64),
     f"Expected input 'input' of shape [-1, -1] with at most {BLOCK} at dim 1 (the longest the model takes). "
     f"Received: [1, {BLOCK + 1}]"),
], ids=["float-ids", "id-beyond-vocabulary", "longer-than-block"])
def test_bad_prompts_are_one_line_400(checkpoint: str, x: torch.Tensor, line: str) -> None:
    """FP32 ids, an id beyond the bytes, one token more than the block: as JSON and as binary."""
    with TestClient(create_app([load_model_spec(f"gpt={checkpoint}")])) as client:
        for binary in (False, True):
            body, headers = encode_request({"input": x}, binary=binary)
            r = client.post("/v2/models/gpt/infer", content=body, headers=headers)
            assert r.status_code == 400 and r.json() == {"error": line}, r.text


class _Pooled(torch.nn.Module):
    """Reads the whole sequence (a mean over time): padding would change every answer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x).mean(dim=1, keepdim=True).expand(-1, x.shape[1], -1)


def test_only_models_whose_answers_padding_leaves_alone_are_padded(reference: torch.nn.Module) -> None:
    """Padding requests into one batch is decided by running the model: the causal GPT and a model of
    each step alone are padded; one that reads the whole sequence (bidirectional attention, a mean
    over time) serves each length in batches of its own."""
    padded = {name: load_model_spec(f"{name}=tests.serve.test_serve_gpt:{name}_factory").pad
              for name in ("encoder", "pooled", "per_step")}
    assert padded == {"encoder": False, "pooled": False, "per_step": True}
    assert ServedModel.from_module("gpt", reference, (-1,), max_shape=(BLOCK,)).pad


def encoder_factory() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8),
                               torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True))


def pooled_factory() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Pooled()


def per_step_factory() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, 3))
