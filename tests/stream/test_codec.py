"""Payload codec: each wire format decodes to the tensors it states; anything else is one line.

The reference is the value written by hand (JSON) or by NumPy itself
(``np.save``, ``np.savez``, ``ndarray.tobytes``).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from partrain.errors import UsageError
from partrain.stream.codec import Codec, MalformedPayload, encode_reply
from partrain.stream.mqtt import parse_address


def test_json_object_and_bare_array():
    item = Codec().decode(b' {"x": [[1, 2.5]], "y": 3, "weight": 0.5, "id": "a7"}')
    assert item.x.dtype == torch.float32 and item.x.tolist() == [[1.0, 2.5]]
    assert item.y.dtype == torch.int64 and item.y.item() == 3  # an integer label: a class index
    assert (item.weight, item.item_id) == (0.5, "a7")
    bare = Codec(input_dtype=torch.float64).decode(b"[0.1, 0.2]")
    assert bare.x.dtype == torch.float64 and bare.x.tolist() == [0.1, 0.2] and bare.y is None


def test_numpy_npy_npz_and_raw_bytes():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    buffer = io.BytesIO()
    np.save(buffer, x)
    assert torch.equal(Codec().decode(buffer.getvalue()).x, torch.from_numpy(x))
    buffer = io.BytesIO()
    np.savez(buffer, x=x, y=np.array([1.5, 2.0]), weight=np.array(2.0), id=np.array(42))
    item = Codec().decode(buffer.getvalue())
    assert torch.equal(item.x, torch.from_numpy(x)) and item.y.tolist() == [1.5, 2.0]
    assert (item.weight, item.item_id) == (2.0, 42)
    raw = Codec(input_shape=(2, 3)).decode(x.astype("<f4").tobytes())
    assert torch.equal(raw.x, torch.from_numpy(x))


@pytest.mark.parametrize("payload, codec, line", [
    (b"", Codec(), "Expected a JSON, .npy, .npz or raw payload. Received: an empty message"),
    (b"\x01\x02abc", Codec(), "Expected a JSON, .npy or .npz payload (raw bytes need an input shape)"),
    (b"\x01\x02abc", Codec(input_shape=(3,)), "Expected 12 raw bytes ([3] of torch.float32). Received: 5 bytes"),
    (b'{"x": [1, 2', Codec(), "Expected valid JSON. Received: JSONDecodeError"),
    (b'{"y": 1}', Codec(), "Expected a JSON object with an 'x' entry or an array. Received: an object with keys ['y']"),
    (b'{"x": [[1], [2, 3]]}', Codec(), "Expected x as a rectangular array of numbers"),
    (b'{"x": ["a"]}', Codec(), "Expected x as a non-empty array of numbers. Received: dtype <U1"),
    (b'{"x": [NaN]}', Codec(), "Expected finite numbers in x. Received: NaN or infinity"),
    (b'{"x": [1], "weight": -2}', Codec(), "Expected a weight >= 0. Received: -2"),
    (b'{"x": [1], "id": [1]}', Codec(), "Expected an id as a string or integer"),
    (b'{"x": [1, 2]}', Codec(input_shape=(3,)), "Expected x of shape [3]. Received: [2]"),
    (b"PK\x03\x04broken", Codec(), "Expected a readable .npz payload"),
])
def test_malformed_payloads_are_one_line(payload, codec, line):
    with pytest.raises(MalformedPayload) as caught:
        codec.decode(payload)
    assert line in str(caught.value) and "\n" not in str(caught.value)


def test_reply_and_address():
    reply = json.loads(encode_reply(torch.tensor([0.1, 0.2], dtype=torch.float64), 7, "a"))
    assert reply == {"id": "a", "version": 7, "prediction": [0.1, 0.2]}
    assert parse_address("127.0.0.1:1884") == ("127.0.0.1", 1884) and parse_address("broker") == ("broker", 1883)
    with pytest.raises(UsageError, match="Expected --mqtt as HOST:PORT"):
        parse_address("host:0")
