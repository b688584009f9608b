"""A table of malformed requests: each gets its 4xx and ``{"error": ...}``, and the
server keeps serving a good request right after each one.
"""

from __future__ import annotations

import json

import pytest
import torch

from partrain.serve.protocol import HEADER, decode_response, encode_request

GOOD = [0.5] * 64


def infer_body(**input_fields) -> bytes:
    item = {"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": GOOD}
    item.update(input_fields)
    item = {k: v for k, v in item.items() if v is not ...}
    return json.dumps({"inputs": [item]}).encode()


def with_request(**fields) -> bytes:
    request = json.loads(infer_body())
    request.update(fields)
    return json.dumps(request).encode()


BINARY_HEAD = json.dumps({"inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32",
                                      "parameters": {"binary_data_size": 256}}]}).encode()
INFER = "/v2/models/digits/infer"

# (id, method, path, body, extra headers, expected status)
CASES = [
    ("invalid-json", "POST", INFER, b"{", {}, 400),
    ("empty-body", "POST", INFER, b"", {}, 400),
    ("json-array", "POST", INFER, b"[]", {}, 400),
    ("not-utf8", "POST", INFER, b"\xff\xfe", {}, 400),
    ("no-inputs", "POST", INFER, b"{}", {}, 400),
    ("empty-inputs", "POST", INFER, b'{"inputs": []}', {}, 400),
    ("inputs-not-list", "POST", INFER, b'{"inputs": {}}', {}, 400),
    ("input-not-object", "POST", INFER, b'{"inputs": [1]}', {}, 400),
    ("missing-name", "POST", INFER, infer_body(name=...), {}, 400),
    ("unknown-input", "POST", INFER, infer_body(name="x"), {}, 400),
    ("wrong-datatype", "POST", INFER, infer_body(datatype="FP64"), {}, 400),
    ("unknown-datatype", "POST", INFER, infer_body(datatype="FLOAT"), {}, 400),
    ("wrong-rank", "POST", INFER, infer_body(shape=[1, 64]), {}, 400),
    ("wrong-dim", "POST", INFER, infer_body(shape=[1, 1, 8, 9], data=[0.5] * 72), {}, 400),
    ("shape-not-ints", "POST", INFER, infer_body(shape=["1", 1, 8, 8]), {}, 400),
    ("shape-negative", "POST", INFER, infer_body(shape=[-1, 1, 8, 8]), {}, 400),
    ("zero-rows", "POST", INFER, infer_body(shape=[0, 1, 8, 8], data=[]), {}, 400),
    ("too-few-elements", "POST", INFER, infer_body(data=[0.5] * 63), {}, 400),
    ("too-many-elements", "POST", INFER, infer_body(data=[0.5] * 65), {}, 400),
    ("string-data", "POST", INFER, infer_body(data=["a"] * 64), {}, 400),
    ("bool-data-for-fp32", "POST", INFER, infer_body(data=[True] * 64), {}, 400),
    ("null-data", "POST", INFER, infer_body(data=[None] * 64), {}, 400),
    ("ragged-nested", "POST", INFER, infer_body(data=[[0.5] * 32, [0.5] * 31]), {}, 400),
    ("no-data", "POST", INFER, infer_body(data=...), {}, 400),
    ("data-and-binary", "POST", INFER, infer_body(parameters={"binary_data_size": 256}), {}, 400),
    ("duplicate-input", "POST", INFER,
     json.dumps({"inputs": [json.loads(infer_body())["inputs"][0]] * 2}).encode(), {}, 400),
    ("binary-too-short", "POST", INFER, BINARY_HEAD + b"\0" * 255, {HEADER: str(len(BINARY_HEAD))}, 400),
    ("binary-extra-bytes", "POST", INFER, BINARY_HEAD + b"\0" * 257, {HEADER: str(len(BINARY_HEAD))}, 400),
    ("header-length-too-big", "POST", INFER, BINARY_HEAD + b"\0" * 256, {HEADER: "99999"}, 400),
    ("header-length-not-number", "POST", INFER, BINARY_HEAD + b"\0" * 256, {HEADER: "abc"}, 400),
    ("header-length-cuts-json", "POST", INFER, BINARY_HEAD + b"\0" * 256, {HEADER: "10"}, 400),
    ("binary-size-negative", "POST", INFER, infer_body(data=..., parameters={"binary_data_size": -4}), {}, 400),
    ("unknown-output", "POST", INFER, with_request(outputs=[{"name": "logits"}]), {}, 400),
    ("binary-data-not-bool", "POST", INFER,
     with_request(outputs=[{"name": "output", "parameters": {"binary_data": "yes"}}]), {}, 400),
    ("timeout-negative", "POST", INFER, with_request(parameters={"timeout": -1}), {}, 400),
    ("id-not-string", "POST", INFER, with_request(id=5), {}, 400),
    ("unknown-model", "POST", "/v2/models/nope/infer", infer_body(), {}, 404),
    ("unknown-version", "POST", "/v2/models/digits/versions/9/infer", infer_body(), {}, 404),
    ("unknown-path", "GET", "/v2/nothing", b"", {}, 404),
    ("get-on-infer", "GET", INFER, b"", {}, 405),
    ("post-on-metadata", "POST", "/v2/models/digits", b"{}", {}, 405),
    ("body-too-large", "POST", INFER, b" " * (64 * 1024 + 1), {}, 413),
]


def good_request(client) -> None:
    x = torch.randn(2, 1, 8, 8)
    body, headers = encode_request({"input": x}, binary=True)
    r = client.post(INFER, content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert decode_response(r.content, r.headers.get(HEADER))["output"].shape == (2, 10)


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("method", "path", "body", "headers", "status"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_malformed_request_gets_4xx_json_error_and_server_keeps_serving(
        client, method: str, path: str, body: bytes, headers: dict, status: int) -> None:
    r = client.request(method, path, content=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error, str) and error
    good_request(client)


def test_streamed_body_over_the_limit_without_content_length_is_413(client) -> None:
    def chunks():
        for _ in range(20):
            yield b" " * 4096

    r = client.post(INFER, content=chunks())
    assert r.status_code == 413 and "at most" in r.json()["error"]
    good_request(client)


def test_error_messages_say_expected_and_received(client) -> None:
    r = client.post(INFER, content=infer_body(datatype="FP64"))
    assert r.json()["error"] == "Expected datatype FP32 for input 'input'. Received: FP64"
    r = client.post(INFER, content=infer_body(data=[0.5] * 63))
    assert r.json()["error"] == "Expected 64 elements for input 'input' of shape [1, 1, 8, 8]. Received: 63"
