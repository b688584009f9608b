"""Request bodies the server decodes before the protocol does (gzip), and the edges of what
JSON can carry both ways (values at a datatype's limit, NaN and Infinity in outputs).

Why: issue 10 saw a gzip body answered with a confusing JSON error, an FP32 input of 1e300
answered 200 with ``null`` outputs, and NaN outputs silently turned into ``null``. The bad
cases are rows of the table in test_malformed.py; here are the good ones: a gzip request
answers exactly what the same request uncompressed does (JSON and binary, one or several
gzip members, any chunking), the largest FP32 and FP16 values still pass, and NaN outputs
come through the binary extension intact.
"""

from __future__ import annotations

import gzip
import json
import zlib

import numpy as np
import pytest
import torch

from partrain.serve.body import BodyDecoder, GzipDecoder, body_decoder
from partrain.serve.protocol import HEADER, ProtocolError, decode_response, encode_request

INFER = "/v2/models/digits/infer"


def digits_request(binary: bool) -> tuple[bytes, dict[str, str]]:
    torch.manual_seed(1)
    return encode_request({"input": torch.randn(3, 1, 8, 8)}, binary=binary, binary_output=binary,
                          request_id="7")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("encoding", ["gzip", "x-gzip", "GZIP", "identity, gzip"])
def test_gzip_request_answers_what_the_plain_request_does(client, binary, encoding) -> None:
    body, headers = digits_request(binary)
    plain = client.post(INFER, content=body, headers=headers)
    # Inference-Header-Content-Length counts bytes of the decompressed body, as in Triton
    squeezed = client.post(INFER, content=gzip.compress(body), headers={**headers, "Content-Encoding": encoding})
    assert plain.status_code == squeezed.status_code == 200, squeezed.text
    assert squeezed.content == plain.content  # byte for byte: same rows, same batch shape
    assert decode_response(squeezed.content, squeezed.headers.get(HEADER))["output"].shape == (3, 10)


def test_gzip_members_and_chunks_decode_to_the_original(client) -> None:
    """Concatenated members are one body (RFC 1952); chunk boundaries anywhere do not matter."""
    body, headers = digits_request(False)
    two_members = gzip.compress(body[:100]) + gzip.compress(body[100:])
    decoder = GzipDecoder(limit=len(body))
    for i in range(0, len(two_members), 7):  # 7-byte chunks: boundaries inside headers and trailers
        decoder.feed(two_members[i:i + 7])
    assert decoder.finish() == body
    r = client.post(INFER, content=two_members, headers={**headers, "Content-Encoding": "gzip"})
    assert r.status_code == 200 and r.json()["id"] == "7"


def test_decompressed_limit_is_exact_and_bounded() -> None:
    """Exactly ``limit`` decompressed bytes pass, one more is 413, and a bomb never expands past it."""
    payload = b"x" * 1000
    ok = GzipDecoder(limit=1000)
    ok.feed(gzip.compress(payload))
    assert ok.finish() == payload
    over = GzipDecoder(limit=999)
    with pytest.raises(ProtocolError) as caught:
        over.feed(gzip.compress(payload))
    assert caught.value.status == 413
    bomb = gzip.compress(b"\0" * 16_000_000)  # 16 MB of zeros in ~16 KB
    small = GzipDecoder(limit=1 << 20)
    with pytest.raises(ProtocolError, match="once decompressed"):
        small.feed(bomb)
    assert small.size <= (1 << 20) + 1  # what was actually expanded before stopping


def test_identity_decoder_and_the_encoding_table() -> None:
    assert type(body_decoder(None, 10)) is BodyDecoder
    assert type(body_decoder("identity", 10)) is BodyDecoder
    assert type(body_decoder(" Gzip ", 10)) is GzipDecoder
    for bad in ("br", "deflate", "gzip, gzip", "compress", "zstd"):
        with pytest.raises(ProtocolError) as caught:
            body_decoder(bad, 10)
        assert caught.value.status == 415 and caught.value.headers == {"Accept-Encoding": "gzip"}
    raw_deflate = zlib.compress(b"{}")  # zlib format is not gzip: refused, not guessed
    decoder = GzipDecoder(limit=100)
    with pytest.raises(ProtocolError, match="not gzip"):
        decoder.feed(raw_deflate)


@pytest.mark.parametrize(("model", "datatype", "value"), [
    ("echo_fp32", "FP32", float(np.finfo(np.float32).max)),
    ("echo_fp32", "FP32", -float(np.finfo(np.float32).max)),
    ("echo_fp32", "FP32", 1e-50),  # too small to represent: rounds to 0, as any float conversion does
    ("echo_fp16", "FP16", 65504.0),
    ("echo_fp16", "FP16", 65519.0),  # rounds to 65504 (the largest FP16), not to Infinity
    ("echo_fp64", "FP64", 1e300),
])
def test_values_at_the_limit_of_a_datatype_pass(client, model, datatype, value) -> None:
    body = {"inputs": [{"name": "input", "shape": [1, 3], "datatype": datatype, "data": [value, 1.0, 2.0]}]}
    r = client.post(f"/v2/models/{model}/infer", content=json.dumps(body).encode())
    assert r.status_code == 200, r.text
    expected = float(np.array(value, dtype=datatype.lower().replace("fp", "float")))
    assert r.json()["outputs"][0]["data"] == [expected, 1.0, 2.0]


def test_nan_outputs_come_through_binary_and_json_refuses_them(client) -> None:
    x = torch.tensor([[-1.0, 0.0, 4.0]])
    body, headers = encode_request({"input": x}, binary_output=True)
    r = client.post("/v2/models/log/infer", content=body, headers=headers)
    assert r.status_code == 200
    y = decode_response(r.content, r.headers.get(HEADER))["output"]
    assert torch.isnan(y[0, 0]) and y[0, 1] == -torch.inf and y[0, 2] == torch.log(torch.tensor(4.0))
    body, headers = encode_request({"input": x})
    r = client.post("/v2/models/log/infer", content=body, headers=headers)
    assert r.status_code == 500 and "null" not in r.text
    assert "Received: 1 NaN, 1 -Infinity among 3 values" in r.json()["error"]
    finite, headers = encode_request({"input": torch.tensor([[1.0, 2.0, 4.0]])})
    assert client.post("/v2/models/log/infer", content=finite, headers=headers).status_code == 200


def test_client_refuses_to_send_nan_as_json() -> None:
    from partrain.serve.protocol import NonFiniteError

    with pytest.raises(NonFiniteError, match="Received: 1 NaN among 2 values"):
        encode_request({"x": torch.tensor([1.0, float("nan")])})
    body, headers = encode_request({"x": torch.tensor([1.0, float("nan")])}, binary=True)
    assert HEADER in headers and len(body) > int(headers[HEADER])
