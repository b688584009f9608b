"""LitServe behind the Open Inference Protocol: the competitor of ``partrain bench serve``.

Not library code: this module exists only so that the serve benchmark can run
LitServe on the same model, path and JSON as ``partrain serve``. It needs the
``bench`` extra (``pip install 'partrain[bench]'``: LitServe) and runs as its own
process::

    python -m partrain.bench._litserve_app NAME FACTORY INPUT_SHAPE MAX_BATCH_SIZE BATCH_TIMEOUT THREADS [DEVICE]

(``INPUT_SHAPE`` of one sample, e.g. ``1,28,28``; ``FACTORY`` as ``module:function``;
``DEVICE`` cpu, the default, or cuda: LitServe's accelerator, where the model runs.)

It picks a free loopback port itself and prints ``litserve: serving NAME at URL``
(the harness waits for that line, then for ``GET /health``).
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import litserve as ls
import torch

from partrain.models import build_model


class OIPLitAPI(ls.LitAPI):
    """One model behind ``/v2/models/NAME/infer``: OIP JSON in and out, LitServe's own batching.

    LitServe speaks no Open Inference Protocol; this API decodes and encodes the
    same JSON ``partrain serve`` answers, so one load generator drives both.
    """

    def __init__(self, name: str, factory: str, threads: int, **kwargs: Any):
        super().__init__(api_path=f"/v2/models/{name}/infer", **kwargs)
        self.name, self.factory, self.threads = name, factory, threads

    def setup(self, device: str) -> None:
        torch.set_num_threads(self.threads)
        self.device = torch.device(device)  # LitServe's choice: "cpu", or "cuda:0" with accelerator="cuda"
        self.model = build_model(self.factory).eval().to(self.device)

    # No annotation on ``request`` nor on encode_response's return: LitServe builds its
    # FastAPI endpoint from them, and any annotation but none turns the body into a query field.
    def decode_request(self, request):  # noqa: ANN001, ANN201 - LitServe passes the parsed JSON body
        (inp,) = request["inputs"]
        x = torch.tensor(inp["data"], dtype=torch.float32).reshape(inp["shape"])
        return request.get("id"), x

    def batch(self, inputs: list[tuple[Any, torch.Tensor]]) -> tuple[list[Any], list[int], torch.Tensor]:
        ids = [request_id for request_id, _ in inputs]
        rows = [x.shape[0] for _, x in inputs]
        return ids, rows, torch.cat([x for _, x in inputs])

    def predict(self, x: Any) -> Any:
        with torch.inference_mode():
            if len(x) == 2:  # not batched: (id, tensor)
                return x[0], self.model(x[1].to(self.device)).cpu()
            ids, rows, xs = x
            return ids, rows, self.model(xs.to(self.device)).cpu()

    def unbatch(self, output: tuple[list[Any], list[int], torch.Tensor]) -> list[tuple[Any, torch.Tensor]]:
        ids, rows, ys = output
        return list(zip(ids, torch.split(ys, rows)))

    def encode_response(self, output: tuple[Any, torch.Tensor]):  # noqa: ANN201 - see decode_request
        request_id, y = output
        return {"id": request_id, "model_name": self.name, "outputs": [
            {"name": "output", "datatype": "FP32", "shape": list(y.shape), "data": y.reshape(-1).tolist()}]}


def _free_port() -> int:
    # LitServe refuses port 0 (it wants 1024..65535): pick one here, in the server's own process
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


USAGE = ("usage: python -m partrain.bench._litserve_app NAME FACTORY INPUT_SHAPE MAX_BATCH_SIZE "
         "BATCH_TIMEOUT THREADS [DEVICE]")


def main(argv: list[str]) -> None:
    """Serve one model: ``NAME FACTORY INPUT_SHAPE MAX_BATCH_SIZE BATCH_TIMEOUT THREADS [DEVICE]``."""
    if len(argv) not in (6, 7) or (argv[6:] or ["cpu"])[0] not in ("cpu", "cuda"):
        sys.exit(USAGE)
    name, factory, input_shape, max_batch_size, batch_timeout, threads = argv[:6]
    accelerator = (argv[6:] or ["cpu"])[0]
    shape = [int(d) for d in input_shape.split(",")]
    torch.set_num_threads(int(threads))
    api = OIPLitAPI(name, factory, int(threads), max_batch_size=int(max_batch_size),
                    batch_timeout=float(batch_timeout))
    server = ls.LitServer(api, accelerator=accelerator, devices=1, workers_per_device=1, timeout=30)
    with torch.inference_mode():  # the output's shape, for the metadata a client may ask for
        output_shape = list(build_model(factory).eval()(torch.zeros(1, *shape)).shape[1:])
    metadata = {"name": name, "versions": ["1"], "platform": "pytorch",
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, *shape]}],
                "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, *output_shape]}]}
    server.app.add_api_route(f"/v2/models/{name}", lambda: metadata, methods=["GET"])
    port = _free_port()
    print(f"litserve: serving {name} at http://127.0.0.1:{port}", flush=True)
    server.run(host="127.0.0.1", port=port, num_api_servers=1, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    # Run through the importable module, not this __main__ copy: LitServe's inference
    # worker unpickles the API as partrain.bench._litserve_app.OIPLitAPI.
    from partrain.bench._litserve_app import main as _main

    _main(sys.argv[1:])
