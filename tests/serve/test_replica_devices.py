"""``run_server(device=...)``: which GPU each replica gets, checked with the GPU count faked.

No GPU is touched: the models' factory only records the device it is given, and
uvicorn is not started (the app is built, then the server returns).
"""

from __future__ import annotations

import pytest
import torch

from partrain.errors import UsageError

replicas = pytest.importorskip("partrain.serve.replicas")


@pytest.fixture()
def two_fake_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def _run(monkeypatch, device: str) -> list:
    given = []

    def make_models(device=None):
        from partrain.serve import ServedModel

        given.append(device)
        return [ServedModel.from_module("m", torch.nn.Linear(2, 2), (2,))]  # on the CPU: only the name is checked

    async def no_uvicorn(app, sock, *, on_ready=None, graceful_timeout=None):
        sock.close()

    monkeypatch.setattr(replicas, "serve_app", no_uvicorn)
    before = torch.get_num_threads()
    try:
        assert replicas.run_server(make_models, port=0, device=device, threads=1) == 0
    finally:
        torch.set_num_threads(before)
    return given


def test_a_named_gpu_gets_the_one_replica(two_fake_gpus, monkeypatch):
    assert _run(monkeypatch, "cuda:1") == ["cuda:1"]


def test_a_gpu_the_machine_lacks_is_one_line(two_fake_gpus, monkeypatch):
    with pytest.raises(UsageError, match=r"Expected a visible CUDA device for --device cuda:5. Received: 2 visible "
                                         r"\(cuda:0 to cuda:1\)"):
        _run(monkeypatch, "cuda:5")
