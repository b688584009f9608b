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


def _top_by_hand(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda i: -row[i])[:k]


def test_classification_extension_answers_the_top_classes_as_value_index_strings(client, digits_model) -> None:
    """Triton's classification extension: BYTES [batch, K] of "<value>:<index>", highest first; the
    reference is the local model's rows ranked by hand."""
    x = torch.randn(5, 1, 8, 8)
    with torch.inference_mode():
        want = digits_model(x)
    request = {"inputs": [{"name": "input", "shape": [5, 1, 8, 8], "datatype": "FP32", "data": x.flatten().tolist()}],
               "outputs": [{"name": "output", "parameters": {"classification": 3}}]}
    r = client.post("/v2/models/digits/infer", json=request)
    assert r.status_code == 200, r.text
    (entry,) = r.json()["outputs"]
    assert (entry["name"], entry["datatype"], entry["shape"]) == ("output", "BYTES", [5, 3])
    for row in range(5):
        got = [s.split(":") for s in entry["data"][3 * row:3 * row + 3]]
        assert [int(i) for _, i in got] == _top_by_hand(want[row].tolist(), 3)
        for value, i in got:
            assert float(value) == pytest.approx(float(want[row, int(i)]), rel=1e-5, abs=1e-5)
    # the same with the binary extension: length-prefixed elements, decoded by the project's client
    request["outputs"][0]["parameters"]["binary_data"] = True
    r = client.post("/v2/models/digits/infer", json=request)
    assert r.status_code == 200, r.text
    got = decode_response(r.content, r.headers.get(HEADER))["output"]
    assert got.shape == (5, 3) and got.reshape(-1).tolist() == entry["data"]


def test_classification_strings_follow_the_spec_example_and_print_the_datatypes_own_value() -> None:
    """The extension's own example: [1, 5, 10, 4] ranks indices [2, 1]; a float32 score is written as
    float32 prints (5.9716883), not as the float64 it widens to (5.971688270568848)."""
    from partrain.serve.protocol import encode_classification

    assert encode_classification("o", torch.tensor([[1, 5, 10, 4]]), 2, False)[0]["data"] == ["10:2", "5:1"]
    entry, blob = encode_classification("o", torch.tensor([[0.1, 5.9716883, 2.4373708]]), 2, True)
    assert blob == b"\x0b\x00\x00\x005.9716883:1" + b"\x0b\x00\x00\x002.4373708:2"
    assert entry == {"name": "o", "shape": [1, 2], "datatype": "BYTES", "parameters": {"binary_data_size": 30}}
    # more classes than the output has, where the model's metadata could not say (-1): the request's error
    with pytest.raises(ProtocolError) as info:
        encode_classification("o", torch.tensor([[1.0, 2.0]]), 3, False)
    assert info.value.status == 400 and "at most 2" in str(info.value)


@pytest.mark.parametrize("model, output, count, message", [
    ("digits", "output", 0, "Expected the classification parameter of output 'output' as a positive integer"),
    ("digits", "output", True, "Received: True"),
    ("digits", "output", "3", "Received: '3'"),
    ("digits", "output", 11, "Expected a classification count of at most 10 (the classes of output 'output'). "
                             "Received: 11"),
    ("pair", "output__1", 1, "Expected classification on an output of shape [batch, classes]. Received: output "
                             "'output__1' of shape [-1]"),
])
def test_a_bad_classification_request_is_a_400(client, model, output, count, message) -> None:
    inputs = {"digits": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0.0] * 64}],
              "pair": [{"name": n, "shape": [1, 4], "datatype": "FP64", "data": [1.0] * 4}
                       for n in ("input__0", "input__1")]}[model]
    path = "/v2/models/pair/versions/7/infer" if model == "pair" else "/v2/models/digits/infer"
    r = client.post(path, json={"inputs": inputs, "outputs": [{"name": output, "parameters": {"classification": count}}]})
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_server_and_model_metadata_health_and_versions(client) -> None:
    assert client.get("/v2").json()["extensions"] == ["binary_tensor_data", "classification"]
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
