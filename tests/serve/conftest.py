"""Shared fixtures: small served models and an app over them (no sockets)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette nags about httpx vs httpx2; both work here
    from starlette.testclient import TestClient

from partrain.models import cnn
from partrain.serve import DATATYPES, ServedModel, TensorSpec, create_app


def train_tiny_gpt(directory, block: int) -> str:  # noqa: ANN001
    """A GPT checkpoint trained by ``partrain train`` on the bundled text (width 16, one layer,
    blocks of ``block`` bytes, two steps) in ``directory``; its path."""
    from partrain.cli import main

    out = directory / "run"
    code = main(["train", "--quiet", "--model", "gpt", "--dataset", "text", "--block-size", str(block),
                 "--model-opt", "n_embd=16", "--model-opt", "n_layer=1", "--workers", "1", "--epochs", "1",
                 "--samples-per-epoch", "64", "--out", str(out)])
    assert code == 0
    return str(out / "checkpoint.pt")


def echo_model(datatype: str) -> ServedModel:
    """Returns its input unchanged: a round trip of one datatype through the server."""
    spec = TensorSpec("input", datatype, (-1, 3))
    return ServedModel(name=f"echo_{datatype.lower()}", fn=lambda x: x.clone(), inputs=[spec],
                       outputs=[TensorSpec("output", datatype, (-1, 3))])


@pytest.fixture(scope="module")
def digits_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return cnn().eval()


@pytest.fixture(scope="module")
def served(digits_model: torch.nn.Module) -> list[ServedModel]:
    def two_heads(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, (a * b).sum(dim=1)

    return [
        ServedModel.from_module("digits", digits_model, (1, 8, 8), max_batch_size=16),
        ServedModel.from_module("pair", two_heads, [(4,), (4,)], dtype=[torch.float64, torch.float64],
                                version="7"),
        *[echo_model(dt) for dt in DATATYPES],
        # log(x): NaN below 0, -Infinity at 0; outputs JSON cannot carry
        ServedModel.from_module("log", torch.log, (3,), dtype=torch.float32),
    ]


@pytest.fixture(scope="module")
def client(served: list[ServedModel]) -> Iterator[TestClient]:
    app = create_app(served, max_body_bytes=64 * 1024)
    with TestClient(app) as c:  # the context manager runs the lifespan: batchers start and drain
        yield c


@pytest.fixture()
def serve() -> Iterator:
    """``serve(misbehave=None, model=None)``: the fake OIP server of `test_loadtest` on a loopback port
    (faults chosen by request id, see `fake_app`); its URL. Every server started is closed after."""
    from .test_loadtest import ServerThread, fake_app, tiny_model

    servers = []

    def start(misbehave=None, model=None):
        server = ServerThread(fake_app(model or tiny_model(), misbehave))
        servers.append(server)
        return server.url

    yield start
    for s in servers:
        s.close()
