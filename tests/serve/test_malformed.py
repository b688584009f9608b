"""A table of malformed requests: each gets its status and ``{"error": "Expected ... Received: ..."}``
(one line, checked for what it says), and the server keeps serving a good request right
after each one. Besides malformed JSON and tensors, the table holds bodies the server must
decode first (``Content-Encoding``), values a datatype cannot hold (1e300 as FP32), and an
answer JSON cannot carry (NaN outputs: a 500 saying so, never ``null``).
"""

from __future__ import annotations

import gzip
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

def gzipped(body: bytes) -> bytes:
    return gzip.compress(body, mtime=0)


def binary_body_without_its_header() -> bytes:
    body, _ = encode_request({"input": torch.zeros(1, 1, 8, 8)}, binary=True)
    return body  # sent without Inference-Header-Content-Length


def fp_body(model: str, datatype: str, data: str) -> tuple[str, bytes]:
    """A request to ``model`` of one row of 3 values, ``data`` written as JSON text."""
    body = f'{{"inputs": [{{"name": "input", "shape": [1, 3], "datatype": "{datatype}", "data": {data}}}]}}'
    return f"/v2/models/{model}/infer", body.encode()


GZIP = {"Content-Encoding": "gzip"}
LOG = "/v2/models/log/infer"

# (id, method, path, body, extra headers, expected status, what the error line says)
CASES = [
    ("invalid-json", "POST", INFER, b"{", {}, 400, "Received invalid JSON (unexpected end of data"),
    ("empty-body", "POST", INFER, b"", {}, 400, "Received: an empty body"),
    ("json-array", "POST", INFER, b"[]", {}, 400, "Expected a JSON object as the request. Received: an array"),
    ("not-utf8", "POST", INFER, b"\xff\xfe", {}, 400, "not valid UTF-8"),
    ("no-inputs", "POST", INFER, b"{}", {}, 400, "Received: no inputs"),
    ("empty-inputs", "POST", INFER, b'{"inputs": []}', {}, 400, "non-empty list of tensors. Received: []"),
    ("inputs-not-list", "POST", INFER, b'{"inputs": {}}', {}, 400, "non-empty list of tensors. Received: {}"),
    ("input-not-object", "POST", INFER, b'{"inputs": [1]}', {}, 400,
     "Expected inputs[0] as an object. Received: a number 1"),
    ("missing-name", "POST", INFER, infer_body(name=...), {}, 400, "Expected inputs[0].name as a string"),
    ("unknown-input", "POST", INFER, infer_body(name="x"), {}, 400, "Expected inputs named ['input']"),
    ("wrong-datatype", "POST", INFER, infer_body(datatype="FP64"), {}, 400,
     "Expected datatype FP32 for input 'input'. Received: FP64"),
    ("unknown-datatype", "POST", INFER, infer_body(datatype="FLOAT"), {}, 400, "Received: 'FLOAT'"),
    ("wrong-rank", "POST", INFER, infer_body(shape=[1, 64]), {}, 400, "of shape [-1, 1, 8, 8] (-1: any)"),
    ("wrong-dim", "POST", INFER, infer_body(shape=[1, 1, 8, 9], data=[0.5] * 72), {}, 400,
     "Received: [1, 1, 8, 9]"),
    ("shape-not-ints", "POST", INFER, infer_body(shape=["1", 1, 8, 8]), {}, 400,
     "shape as a list of non-negative integers"),
    ("shape-negative", "POST", INFER, infer_body(shape=[-1, 1, 8, 8]), {}, 400,
     "shape as a list of non-negative integers"),
    ("zero-rows", "POST", INFER, infer_body(shape=[0, 1, 8, 8], data=[]), {}, 400, "at least one row"),
    ("too-few-elements", "POST", INFER, infer_body(data=[0.5] * 63), {}, 400, "Expected 64 elements"),
    ("too-many-elements", "POST", INFER, infer_body(data=[0.5] * 65), {}, 400, "Received: 65"),
    ("string-data", "POST", INFER, infer_body(data=["a"] * 64), {}, 400,
     "Expected numbers for input 'input' of datatype FP32. Received: \"a\" at element 0"),
    ("bool-data-for-fp32", "POST", INFER, infer_body(data=[True] * 64), {}, 400, "Received: true at element 0"),
    ("null-data", "POST", INFER, infer_body(data=[0.5] * 5 + [None] * 59), {}, 400,
     "Received: null at element 5"),
    ("ragged-nested", "POST", INFER, infer_body(data=[[0.5] * 32, [0.5] * 31]), {}, 400,
     "Received: nested lists of different lengths"),
    ("no-data", "POST", INFER, infer_body(data=...), {}, 400, "Expected 'data' (or binary_data_size)"),
    ("data-and-binary", "POST", INFER, infer_body(parameters={"binary_data_size": 256}), {}, 400,
     "Received: both"),
    ("duplicate-input", "POST", INFER,
     json.dumps({"inputs": [json.loads(infer_body())["inputs"][0]] * 2}).encode(), {}, 400,
     "Received: 'input' twice"),
    ("binary-too-short", "POST", INFER, BINARY_HEAD + b"\0" * 255, {HEADER: str(len(BINARY_HEAD))}, 400,
     "Expected 256 bytes of binary data after the JSON header. Received: 255"),
    ("binary-extra-bytes", "POST", INFER, BINARY_HEAD + b"\0" * 257, {HEADER: str(len(BINARY_HEAD))}, 400,
     "Received: 257"),
    ("header-length-too-big", "POST", INFER, BINARY_HEAD + b"\0" * 256, {HEADER: "99999"}, 400,
     "Received: '99999'"),
    ("header-length-not-number", "POST", INFER, BINARY_HEAD + b"\0" * 256, {HEADER: "abc"}, 400,
     "Received: 'abc'"),
    ("header-length-cuts-json", "POST", INFER, BINARY_HEAD + b"\0" * 256, {HEADER: "10"}, 400,
     "Expected the body's first 10 bytes (Inference-Header-Content-Length) to be a JSON object"),
    ("binary-without-header-length", "POST", INFER, binary_body_without_its_header(), {}, 400,
     "Received: 256 bytes after a"),
    ("binary-size-negative", "POST", INFER, infer_body(data=..., parameters={"binary_data_size": -4}), {}, 400,
     "binary_data_size of input 'input' as a non-negative integer"),
    ("unknown-output", "POST", INFER, with_request(outputs=[{"name": "logits"}]), {}, 400,
     "Expected outputs among ['output']. Received: 'logits'"),
    ("binary-data-not-bool", "POST", INFER,
     with_request(outputs=[{"name": "output", "parameters": {"binary_data": "yes"}}]), {}, 400,
     "Expected binary_data as true/false"),
    ("timeout-negative", "POST", INFER, with_request(parameters={"timeout": -1}), {}, 400,
     "non-negative microseconds"),
    ("id-not-string", "POST", INFER, with_request(id=5), {}, 400, "Expected 'id' as a string. Received: a number"),
    # values a datatype cannot hold: refused, never computed as Infinity
    ("fp32-out-of-range", "POST", INFER, infer_body(data=[0.5] * 63 + [1e300]), {}, 400,
     "Expected FP32 values within +-3.4028235e+38 for input 'input'. Received: 1e+300"),
    ("fp32-negative-out-of-range", "POST", INFER, infer_body(data=[-3.5e38] + [0.5] * 63), {}, 400,
     "Received: -3.5e+38"),
    ("fp32-integer-out-of-range", "POST", INFER, infer_body(data=[10 ** 39] + [0.5] * 63), {}, 400,
     "Expected FP32 values within"),
    ("fp16-out-of-range", "POST", *fp_body("echo_fp16", "FP16", "[1.0, 70000.0, 2.0]"), {}, 400,
     "Expected FP16 values within +-65504 for input 'input'. Received: 70000"),
    ("fp64-beyond-double", "POST", *fp_body("echo_fp64", "FP64", "[1.0, 1e400, 2.0]"), {}, 400,
     "whose numbers fit FP64"),
    # outputs JSON cannot carry (NaN, Infinity): a 500 that says so, never null
    ("nan-output-as-json", "POST", *fp_body("log", "FP32", "[-1.0, 0.0, 1.0]"), {}, 500,
     "Expected finite values in output 'output' of model 'log' to answer in JSON"),
    # bodies: Content-Encoding
    ("gzip-corrupt", "POST", INFER, b"not gzip at all", GZIP, 400,
     "Expected a gzip body, as its 'Content-Encoding: gzip' says. Received: bytes that are not gzip"),
    ("gzip-truncated", "POST", INFER, gzipped(infer_body())[:-12], GZIP, 400,
     "Received: a gzip stream cut short"),
    ("gzip-empty", "POST", INFER, b"", GZIP, 400, "Received: an empty body"),
    ("gzip-trailing-garbage", "POST", INFER, gzipped(infer_body()) + b"junk", GZIP, 400,
     "Received: bytes that are not gzip"),
    ("gzip-bomb", "POST", INFER, gzipped(b" " * (64 * 1024 + 1)), GZIP, 413,
     "Expected a body of at most 65536 bytes. Received: more once decompressed"),
    ("gzip-without-content-encoding", "POST", INFER, gzipped(infer_body()), {}, 400,
     "a gzip-compressed body needs the header 'Content-Encoding: gzip'. Received: gzip data without it"),
    ("encoding-br", "POST", INFER, infer_body(), {"Content-Encoding": "br"}, 415,
     "Expected Content-Encoding gzip or identity (or none). Received: Content-Encoding 'br'"),
    ("encoding-deflate", "POST", INFER, infer_body(), {"Content-Encoding": "deflate"}, 415, "'deflate'"),
    ("encoding-gzip-twice", "POST", INFER, gzipped(gzipped(infer_body())), {"Content-Encoding": "gzip, gzip"},
     415, "Received: Content-Encoding 'gzip, gzip'"),
    ("index-bad-json", "POST", "/v2/repository/index", b"{", {}, 400, "Expected a JSON object like"),
    ("index-ready-not-bool", "POST", "/v2/repository/index", b'{"ready": 1}', {}, 400,
     "Expected a JSON object like"),
    ("unknown-model", "POST", "/v2/models/nope/infer", infer_body(), {}, 404,
     "Expected a model among ['digits', "),
    ("unknown-version", "POST", "/v2/models/digits/versions/9/infer", infer_body(), {}, 404,
     "Expected version '1' of model 'digits'. Received: '9'"),
    ("unknown-path", "GET", "/v2/nothing", b"", {}, 404,
     "Expected a path of the Open Inference Protocol v2 (/v2, "),
    ("get-on-infer", "GET", INFER, b"", {}, 405, "Expected method POST for /v2/models/digits/infer. Received: GET"),
    ("post-on-metadata", "POST", "/v2/models/digits", b"{}", {}, 405, "Received: POST"),
    ("post-on-listing", "POST", "/v2/models", b"{}", {}, 405, "Received: POST"),
    ("body-too-large", "POST", INFER, b" " * (64 * 1024 + 1), {}, 413,
     "Expected a body of at most 65536 bytes. Received: 65537 bytes"),
]


def good_request(client) -> None:
    x = torch.randn(2, 1, 8, 8)
    body, headers = encode_request({"input": x}, binary=True)
    r = client.post(INFER, content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert decode_response(r.content, r.headers.get(HEADER))["output"].shape == (2, 10)


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 20 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "says"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_malformed_request_gets_its_status_and_one_line_and_server_keeps_serving(
        client, method: str, path: str, body: bytes, headers: dict, status: int, says: str) -> None:
    r = client.request(method, path, content=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error, str) and "\n" not in error
    assert error.startswith("Expected ") and "Received" in error, error
    assert says in error, error
    if status == 415:
        assert r.headers["accept-encoding"] == "gzip"  # RFC 7694: what would have been accepted
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
