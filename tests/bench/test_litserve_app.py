"""The LitServe adapter of ``partrain bench serve`` answers OIP JSON like the model itself.

LitServe is an optional extra (``bench``): without it this module is skipped and
the benchmark says so. With it, the adapter's request path (decode, batch,
predict, unbatch, encode) is checked here without a server against the model
called directly, so a wrong answer counted against LitServe in the benchmark is
LitServe's, not the adapter's. The served path itself runs in the serve smoke
test when LitServe is installed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("litserve")

from partrain.bench._litserve_app import OIPLitAPI  # noqa: E402 - after the skip
from partrain.bench.serve import lenet_factory  # noqa: E402


def test_batched_requests_come_back_as_the_models_own_answers():
    api = OIPLitAPI("lenet", "partrain.bench.serve:lenet_factory", threads=1, max_batch_size=4, batch_timeout=0.0)
    api.setup("cpu")
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(rows, 1, 28, 28, generator=g) for rows in (1, 2)]
    requests = [{"id": f"r{i}", "inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                            "data": x.reshape(-1).tolist()}]} for i, x in enumerate(images)]
    outputs = api.unbatch(api.predict(api.batch([api.decode_request(r) for r in requests])))
    answers = [api.encode_response(o) for o in outputs]

    with torch.inference_mode():
        expected = [lenet_factory()(x) for x in images]
    for i, (answer, want) in enumerate(zip(answers, expected)):
        assert answer["id"] == f"r{i}" and answer["model_name"] == "lenet"
        (out,) = answer["outputs"]
        assert out["datatype"] == "FP32" and out["shape"] == list(want.shape)
        # float32 model, the same weights and inputs; batching may change the kernels' summation order
        torch.testing.assert_close(torch.tensor(out["data"]).reshape(out["shape"]), want, atol=1e-5, rtol=1e-4)
