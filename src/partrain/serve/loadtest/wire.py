"""Request bodies and answers on the wire, through the one OIP codec (`partrain.serve.protocol`).

The load generator adds only a cache: each sample's tensors are encoded once and
every request reuses them with its own ``id``, so encoding never limits the load.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ...errors import UsageError
from ..protocol import HEADER, NonFiniteError, decode_infer_response, encode_request


class RequestEncoder:
    """Builds infer request bodies; the tensor part of each sample is encoded once.

    JSON: ``{"id": ..., "inputs": [{"name", "shape", "datatype", "data": [flat]}]}``.
    Binary extension: the same JSON header with ``parameters.binary_data_size``
    instead of ``data``, followed by the raw little-endian bytes, and the header's
    length in ``Inference-Header-Content-Length``; outputs are asked for as binary.
    """

    def __init__(self, samples: Sequence[Mapping[str, np.ndarray]], binary: bool = False):
        self.binary = binary
        self._parts: list[tuple[bytes, bytes]] = []
        for index, sample in enumerate(samples):
            try:
                body, headers = encode_request(sample, binary=binary, binary_output=binary)
            except NonFiniteError as exc:
                raise UsageError(f"Expected finite input values to send as JSON (JSON numbers cannot be "
                                 f"NaN or Infinity). Received: {exc.found} in input {exc.name!r} of "
                                 f"sample {index}; send them with --binary") from None
            head_length = int(headers.get(HEADER, len(body)))
            # the JSON header without its opening brace: '{"id":"<id>",' is prepended per request
            self._parts.append((body[1:head_length], body[head_length:]))

    def __len__(self) -> int:
        return len(self._parts)

    def encode(self, request_id: str, sample: int) -> tuple[bytes, dict[str, str]]:
        """Body and headers of request ``request_id`` carrying sample number ``sample``."""
        tail, raw = self._parts[sample]
        header = b'{"id":"' + request_id.encode() + b'",' + tail
        if not self.binary:
            return header, {"Content-Type": "application/json"}
        return header + raw, {"Content-Type": "application/octet-stream", HEADER: str(len(header))}


def read_answer(content: bytes, headers: Mapping[str, str] | None) -> tuple[str | None, dict[str, np.ndarray]]:
    """The echoed ``id`` and the output arrays of an infer response (JSON or binary extension).

    Raises `partrain.serve.ProtocolError` (or `ValueError`) for an answer that is
    not a well-formed response.
    """
    length = None
    if headers is not None:
        length = headers.get(HEADER) or headers.get(HEADER.lower())
    response = decode_infer_response(content, length)
    return response.id, {name: t.numpy() for name, t in response.outputs.items()}
