"""`partrain serve module:factory` without --input-shape: the first layer decides, requests are checked.

Guards issue 9's "a Triton client could not reach a plain Sequential": the
input shape is read from the first parameterised layer (`partrain.serve.shapes`),
the model metadata says so with -1 for dynamic dims as the Open Inference
Protocol writes them, every answer equals the model called directly on the same
input, a request whose shape cannot fit is a 400 with one "Expected ... Received"
line, requests of different dynamic sizes are never batched together, and a model
whose input nothing determines gets one line asking for the flag.

Start with `test_first_layer_determines_the_input`, the table of rules. Models
run in float64 (built with ``.double()``): answers are compared with the direct
call at 1e-12, and batching (several rows per call) cannot move float64 sums
that far on any CPU or thread count.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from torch import nn

from partrain.cli import main
from partrain.serve import ServedModel, create_app
from partrain.serve.loading import load_model_spec
from partrain.serve.protocol import HEADER, decode_response, encode_request
from partrain.serve.shapes import ShapeNotInferred, infer_input

from .conftest import TestClient


def linear_factory() -> nn.Module:
    """The issue's model: nothing about its input is recorded anywhere but in its first layer."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()


class ShapeRecorder(nn.Module):
    """Records the input shape of every call, so a test can see what was batched together."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(x.shape))
        return x


def conv_factory() -> nn.Module:
    """Fully convolutional: any image size, output spatial size follows the input's."""
    torch.manual_seed(0)
    return nn.Sequential(ShapeRecorder(), nn.Conv2d(3, 5, 3, padding=1), nn.Tanh(), nn.Conv2d(5, 2, 1)).double()


def embedding_factory() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 6), nn.Linear(6, 3)).double()


def lstm_factory() -> nn.Module:
    return nn.LSTM(4, 8)


def flatten_factory() -> nn.Module:
    """Conv2d then Flatten + Linear: only 28x28 images fit, a size no example tries."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 26 * 26, 10))


# ----------------------------------------------------------------- the rules (no server)


@pytest.mark.parametrize(("module", "shape", "dtype"), [
    (nn.Linear(8, 4), (8,), torch.float32),
    (nn.Sequential(nn.Sequential(nn.Dropout(), nn.Linear(8, 4).double()), nn.ReLU()), (8,), torch.float64),
    (nn.Conv1d(3, 4, 3), (3, -1), torch.float32),
    (nn.Sequential(nn.Identity(), nn.Conv2d(3, 4, 3)), (3, -1, -1), torch.float32),
    (nn.Conv3d(2, 4, 3), (2, -1, -1, -1), torch.float32),
    (nn.ConvTranspose2d(6, 4, 3), (6, -1, -1), torch.float32),
    (nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)), (-1,), torch.int64),
    (torch.jit.script(nn.Sequential(nn.Linear(5, 2))), (5,), torch.float32),
], ids=["linear", "nested-float64", "conv1d", "conv2d", "conv3d", "conv-transpose", "embedding", "torchscript"])
def test_first_layer_determines_the_input(module: nn.Module, shape: tuple, dtype: torch.dtype) -> None:
    inferred = infer_input(module)
    assert (inferred.shape, inferred.dtype) == (shape, dtype)


@pytest.mark.parametrize(("module", "why"), [
    (nn.LSTM(4, 8), "LSTM, does not determine"),
    (nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2)), "LayerNorm, does not determine"),
    (nn.Identity(), "no layer with parameters"),
    (nn.LazyLinear(3), "lazy"),
    (lambda x: x, "not an nn.Module"),
])
def test_layers_that_determine_nothing_say_why(module, why: str) -> None:
    with pytest.raises(ShapeNotInferred, match=why):
        infer_input(module)


# ----------------------------------------------------------------- served without the flag


def _client(*models: ServedModel) -> TestClient:
    return TestClient(create_app(list(models)))


def _infer(client: TestClient, name: str, x: torch.Tensor) -> torch.Tensor:
    body, headers = encode_request({"input": x}, binary=True, binary_output=True)
    r = client.post(f"/v2/models/{name}/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    return decode_response(r.content, r.headers.get(HEADER))["output"]


def test_metadata_follows_the_protocol_with_dynamic_dims() -> None:
    """OIP model metadata: shape is a list of ints, -1 for a variable-size dim (the batch dim too)."""
    models = [load_model_spec(f"{n}=tests.serve.test_shapes:{n}_factory") for n in ("linear", "conv", "embedding")]
    with _client(*models) as client:
        meta = {n: client.get(f"/v2/models/{n}").json() for n in ("linear", "conv", "embedding")}
    assert meta["linear"]["inputs"] == [{"name": "input", "datatype": "FP64", "shape": [-1, 8]}]
    assert meta["linear"]["outputs"] == [{"name": "output", "datatype": "FP64", "shape": [-1, 4]}]
    assert meta["conv"]["inputs"] == [{"name": "input", "datatype": "FP64", "shape": [-1, 3, -1, -1]}]
    assert meta["conv"]["outputs"] == [{"name": "output", "datatype": "FP64", "shape": [-1, 2, -1, -1]}]
    assert meta["embedding"]["inputs"] == [{"name": "input", "datatype": "INT64", "shape": [-1, -1]}]
    assert meta["embedding"]["outputs"] == [{"name": "output", "datatype": "FP64", "shape": [-1, -1, 3]}]


@pytest.mark.parametrize(("name", "shapes"), [("linear", [(1, 8), (3, 8)]),
                                             ("conv", [(1, 3, 5, 5), (2, 3, 8, 4)])])
def test_model_served_without_the_flag_answers_like_the_model_called_directly(name: str, shapes) -> None:
    reference = globals()[f"{name}_factory"]().eval()
    with _client(load_model_spec(f"{name}=tests.serve.test_shapes:{name}_factory")) as client:
        for shape in shapes:
            x = torch.randn(shape, dtype=torch.float64)
            with torch.inference_mode():
                want = reference(x)
            torch.testing.assert_close(_infer(client, name, x), want, rtol=0, atol=1e-12)


def test_embedding_model_takes_indices_of_any_length() -> None:
    reference = embedding_factory().eval()
    with _client(load_model_spec("emb=tests.serve.test_shapes:embedding_factory")) as client:
        for length in (2, 7):
            x = torch.randint(0, 50, (2, length))
            with torch.inference_mode():
                want = reference(x)
            torch.testing.assert_close(_infer(client, "emb", x), want, rtol=0, atol=1e-12)


def test_conv_model_batches_only_equal_sizes_and_answers_each_right() -> None:
    """Concurrent requests of two image sizes: each answer is the direct call's, no call was padded."""
    served = conv_factory()
    model = ServedModel.from_module("conv", served, max_batch_size=16, policy="fixed:20")  # no input_shape
    assert model.inputs[0].shape == (-1, 3, -1, -1)
    served[0].calls.clear()  # forget the example runs
    reference = conv_factory().eval()
    app = create_app([model])
    sizes = [(6, 6), (9, 5)]
    xs = [torch.randn(1 + i % 2, 3, *sizes[i % 2], dtype=torch.float64) for i in range(18)]

    async def run() -> list[torch.Tensor]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            async def one(x: torch.Tensor) -> torch.Tensor:
                body, headers = encode_request({"input": x}, binary=True, binary_output=True)
                r = await c.post("/v2/models/conv/infer", content=body, headers=headers)
                assert r.status_code == 200, r.text
                return decode_response(r.content, r.headers.get(HEADER))["output"]

            try:
                return await asyncio.gather(*(one(x) for x in xs))
            finally:
                await app.state.batchers["conv"].stop()

    outs = asyncio.run(run())
    with torch.inference_mode():
        for x, got in zip(xs, outs):
            torch.testing.assert_close(got, reference(x), rtol=0, atol=1e-12)
    calls = served[0].calls
    assert {s[2:] for s in calls} == set(sizes)  # each call one request size: grouped, never padded
    assert sum(s[0] for s in calls) == sum(x.shape[0] for x in xs)


def test_request_shape_that_cannot_fit_is_one_line_400() -> None:
    models = [load_model_spec(f"{n}=tests.serve.test_shapes:{n}_factory") for n in ("linear", "conv")]
    cases = [
        ("linear", torch.zeros(1, 9, dtype=torch.float64), "Expected input 'input' of shape [-1, 8]"),
        ("linear", torch.zeros(1, 2, 4, dtype=torch.float64), "Received: [1, 2, 4]"),  # rank
        ("conv", torch.zeros(1, 4, 6, 6, dtype=torch.float64), "Expected input 'input' of shape [-1, 3, -1, -1]"),
        ("conv", torch.zeros(1, 3, 6, dtype=torch.float64), "Received: [1, 3, 6]"),  # rank
    ]
    with _client(*models) as client:
        for name, x, message in cases:
            body, headers = encode_request({"input": x})
            r = client.post(f"/v2/models/{name}/infer", content=body, headers=headers)
            error = r.json()["error"]
            assert r.status_code == 400 and message in error, error
            assert error.startswith("Expected") and "Received" in error and "\n" not in error


# ----------------------------------------------------------------- the flag, only when needed


def test_cli_asks_for_the_flag_in_one_line_only_when_nothing_determines_the_shape(capsys) -> None:
    for factory, why in [("lstm_factory", "its first parameterised layer, LSTM, does not determine"),
                         ("flatten_factory", "its first layer, Conv2d(in_channels=1), suggests inputs of shape "
                                             "[-1, 1, -1, -1]")]:
        assert main(["serve", f"m=tests.serve.test_shapes:{factory}", "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Expected --input-shape" in err and why in err, err
        assert "Received: no --input-shape" in err
    # with the flag, the same model serves (the flag wins over anything inferred)
    model = load_model_spec("m=tests.serve.test_shapes:flatten_factory", input_shape="1,28,28")
    assert model.inputs[0].shape == (-1, 1, 28, 28) and model.outputs[0].shape == (-1, 10)
