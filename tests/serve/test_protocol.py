"""Open Inference Protocol codec and endpoints: JSON and binary, every datatype.

Codec tests call `partrain.serve.protocol` directly; endpoint tests go through
Starlette's TestClient (no sockets). The reference for inference is the model
run locally on the same input.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from partrain.serve import DATATYPES, ServedModel
from partrain.serve.protocol import (
    HEADER,
    ProtocolError,
    decode_infer_request,
    decode_response,
    encode_request,
)

from .conftest import echo_model


def sample(datatype: str, rows: int = 2) -> torch.Tensor:
    """Values that exercise each datatype's range (extremes included)."""
    torch_dtype, np_dtype = DATATYPES[datatype]
    if datatype == "BOOL":
        arr = np.array([[True, False, True]] * rows)
    elif np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        arr = np.array([[info.min, 0, info.max]] * rows, dtype=np_dtype)
    else:
        arr = np.array([[-1.5, 0.25, 1e3]] * rows, dtype=np_dtype)
    return torch.from_numpy(arr.astype(np_dtype.newbyteorder("="))).to(torch_dtype)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_codec_round_trip_every_datatype(datatype: str, binary: bool) -> None:
    x = sample(datatype)
    body, headers = encode_request({"input": x}, binary=binary)
    req = decode_infer_request(body, headers.get(HEADER), echo_model(datatype))
    assert req.inputs[0].dtype == x.dtype and torch.equal(req.inputs[0], x)
    # the load generator encodes numpy arrays through the same codec: same bytes, any byte order
    arr = x.numpy()
    assert encode_request({"input": arr}, binary=binary) == (body, headers)
    swapped = arr.astype(arr.dtype.newbyteorder(">"))
    assert encode_request({"input": swapped}, binary=binary) == (body, headers)


def test_nested_and_flat_data_decode_the_same() -> None:
    model = echo_model("FP32")
    flat = {"inputs": [{"name": "input", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, 4, 5, 6]}]}
    nested = {"inputs": [{"name": "input", "shape": [2, 3], "datatype": "FP32", "data": [[1, 2, 3], [4, 5, 6]]}]}
    a = decode_infer_request(json.dumps(flat).encode(), None, model).inputs[0]
    b = decode_infer_request(json.dumps(nested).encode(), None, model).inputs[0]
    assert torch.equal(a, b) and torch.equal(a, torch.arange(1.0, 7.0).reshape(2, 3))


def test_codec_rejects_integer_overflow_and_floats_for_ints() -> None:
    model = echo_model("INT8")
    for data in ([1, 2, 300], [1.5, 2, 3]):
        body = json.dumps({"inputs": [{"name": "input", "shape": [1, 3], "datatype": "INT8", "data": data}]})
        with pytest.raises(ProtocolError) as info:
            decode_infer_request(body.encode(), None, model)
        assert info.value.status == 400


@pytest.mark.parametrize("binary_in", [False, True])
@pytest.mark.parametrize("binary_out", [False, True])
@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_endpoint_round_trip_every_datatype(client, datatype: str, binary_in: bool, binary_out: bool) -> None:
    x = sample(datatype, rows=3)
    body, headers = encode_request({"input": x}, binary=binary_in, binary_output=binary_out, request_id="r1")
    r = client.post(f"/v2/models/echo_{datatype.lower()}/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert (HEADER in r.headers) == binary_out
    if not binary_out:
        doc = r.json()
        assert doc["id"] == "r1" and doc["model_name"] == f"echo_{datatype.lower()}"
        assert doc["outputs"][0]["datatype"] == datatype and doc["outputs"][0]["shape"] == [3, 3]
    out = decode_response(r.content, r.headers.get(HEADER))["output"]
    assert out.dtype == x.dtype and torch.equal(out, x)


def test_infer_json_and_binary_match_the_local_model(client, digits_model) -> None:
    x = torch.randn(5, 1, 8, 8)
    with torch.inference_mode():
        want = digits_model(x)
    for binary in (False, True):
        body, headers = encode_request({"input": x}, binary=binary, binary_output=binary)
        r = client.post("/v2/models/digits/infer", content=body, headers=headers)
        assert r.status_code == 200, r.text
        got = decode_response(r.content, r.headers.get(HEADER))["output"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_binary_output_per_output_and_multi_input_model(client) -> None:
    a, b = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    request = {
        "inputs": [
            {"name": "input__1", "shape": [2, 4], "datatype": "FP64", "data": b.flatten().tolist()},
            {"name": "input__0", "shape": [2, 4], "datatype": "FP64", "data": a.flatten().tolist()},
        ],
        "outputs": [{"name": "output__1", "parameters": {"binary_data": True}}, {"name": "output__0"}],
    }
    r = client.post("/v2/models/pair/versions/7/infer", json=request)
    assert r.status_code == 200, r.text
    header_len = int(r.headers[HEADER])
    head = json.loads(r.content[:header_len])
    assert [o["name"] for o in head["outputs"]] == ["output__1", "output__0"]
    assert head["outputs"][0]["parameters"]["binary_data_size"] == 2 * 8 and "data" in head["outputs"][1]
    outs = decode_response(r.content, r.headers[HEADER])
    torch.testing.assert_close(outs["output__0"], a + b)
    torch.testing.assert_close(outs["output__1"], (a * b).sum(dim=1))


def test_server_and_model_metadata_health_and_versions(client) -> None:
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data"]
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}
    meta = client.get("/v2/models/digits").json()
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]
    assert meta["versions"] == ["1"]
    assert client.get("/v2/models/digits/versions/1").json() == meta
    assert client.get("/v2/models/digits/ready").json() == {"name": "digits", "ready": True}
    assert client.get("/v2/models/pair/versions/7/ready").status_code == 200
    assert client.get("/v2/models/pair/versions/1/ready").status_code == 404
    pair = client.get("/v2/models/pair").json()
    assert [i["name"] for i in pair["inputs"]] == ["input__0", "input__1"]


def test_served_model_from_module_infers_output_metadata() -> None:
    m = ServedModel.from_module("t", lambda x: (x.argmax(dim=1), x.float().mean(dim=1)), (5,))
    assert [(o.name, o.datatype, o.shape) for o in m.outputs] == [("output__0", "INT64", (-1,)),
                                                                    ("output__1", "FP32", (-1,))]
