"""Message payloads to items, predictions to replies: JSON, NumPy ``.npy``/``.npz``, raw bytes.

An item's payload is one of (told apart by its first bytes, never by guessing):

- **JSON** (starts with ``{`` or ``[`` after blanks): ``{"x": ..., "y": ..., "weight": w,
  "id": "..."}`` (only ``x`` required), or a bare array, which is ``x``. Floats become
  ``input_dtype`` (default float32); an integer label stays int64 (class indices);
- **NumPy** ``.npy`` (``np.save``; magic ``\\x93NUMPY``): the array is ``x``;
- **NumPy** ``.npz`` (``np.savez``; a zip): arrays ``x`` and optionally ``y``, ``weight``,
  ``id``; read with ``allow_pickle=False``: no code is unpickled;
- **raw** bytes: only with a known ``input_shape``: ``x`` as the little-endian bytes of
  ``input_dtype`` in C order.

A reply is JSON: ``{"id": ..., "version": v, "prediction": [...]}``.
Anything that does not decode raises `MalformedPayload` with one line saying why.
"""

from __future__ import annotations

import array
import io
import json
import math
import zipfile
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..errors import error_line

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK\x03\x04"
MAX_ID_CHARS = 256
#: `array.array` type codes of the dtypes a flat JSON list becomes
_TYPECODES = {torch.float32: "f", torch.float64: "d", torch.int64: "q"}


class MalformedPayload(ValueError):
    """A message that is not an item: the message says what was expected and what was received."""


@dataclass
class Decoded:
    """One decoded item."""

    x: Tensor
    y: Tensor | None = None
    weight: float = 1.0
    item_id: Hashable | None = None


@dataclass(frozen=True)
class Codec:
    """Decodes payloads to `Decoded` items (``input_shape``: one sample's shape, no batch dim)."""

    input_shape: tuple[int, ...] | None = None
    input_dtype: torch.dtype = torch.float32

    def decode(self, payload: bytes) -> Decoded:
        if not payload:
            raise MalformedPayload("Expected a JSON, .npy, .npz or raw payload. Received: an empty message")
        head = payload[:16].lstrip()
        if head[:1] in (b"{", b"["):
            item = self._json(payload)
        elif payload.startswith(NPY_MAGIC):
            item = Decoded(self._tensor(_npy(payload), "x"))
        elif payload.startswith(ZIP_MAGIC):
            item = self._npz(payload)
        elif self.input_shape is not None:
            item = Decoded(self._raw(payload))
        else:
            raise MalformedPayload(f"Expected a JSON, .npy or .npz payload (raw bytes need an input shape). "
                                   f"Received: {len(payload)} bytes starting {payload[:8]!r}")
        if self.input_shape is not None and tuple(item.x.shape) != self.input_shape:
            raise MalformedPayload(f"Expected x of shape {list(self.input_shape)}. Received: {list(item.x.shape)}")
        return item

    def decode_json(self, line: bytes) -> Decoded:
        """One JSON item (a line of ``--input``): no binary formats."""
        item = self._json(line)
        if self.input_shape is not None and tuple(item.x.shape) != self.input_shape:
            raise MalformedPayload(f"Expected x of shape {list(self.input_shape)}. Received: {list(item.x.shape)}")
        return item

    def _json(self, payload: bytes) -> Decoded:
        try:
            body = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedPayload(f"Expected valid JSON. Received: {type(exc).__name__}: {exc}") from None
        if isinstance(body, list):
            return Decoded(self._tensor(body, "x"))
        if not isinstance(body, dict) or "x" not in body:
            got = f"an object with keys {sorted(body)[:8]}" if isinstance(body, dict) else type(body).__name__
            raise MalformedPayload(f"Expected a JSON object with an 'x' entry or an array. Received: {got}")
        y = body.get("y")
        return Decoded(self._tensor(body["x"], "x"), None if y is None else self._tensor(y, "y"),
                       _weight(body.get("weight", 1.0)), _item_id(body.get("id")))

    def _npz(self, payload: bytes) -> Decoded:
        try:
            with np.load(io.BytesIO(payload), allow_pickle=False) as arrays:
                found = {k: arrays[k] for k in arrays.files}
        except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
            raise MalformedPayload(f"Expected a readable .npz payload. Received: {type(exc).__name__}: "
                                   f"{str(exc)[:120]}") from None
        if "x" not in found:
            raise MalformedPayload(f"Expected an array 'x' in the .npz payload. Received: {sorted(found)}")
        y = found.get("y")
        weight = found.get("weight")
        item_id = found.get("id")
        return Decoded(self._tensor(found["x"], "x"), None if y is None else self._tensor(y, "y"),
                       1.0 if weight is None else _weight(weight.item() if weight.size == 1 else weight.tolist()),
                       None if item_id is None else _item_id(item_id.item() if item_id.size == 1 else None))

    def _raw(self, payload: bytes) -> Tensor:
        assert self.input_shape is not None
        itemsize = torch.tensor([], dtype=self.input_dtype).element_size()
        count = math.prod(self.input_shape)
        if len(payload) != count * itemsize:
            raise MalformedPayload(f"Expected {count * itemsize} raw bytes ({list(self.input_shape)} of "
                                   f"{self.input_dtype}). Received: {len(payload)} bytes")
        array = np.frombuffer(payload, dtype=_numpy_dtype(self.input_dtype).newbyteorder("<"))
        return torch.from_numpy(array.astype(array.dtype.newbyteorder("="))).reshape(self.input_shape)

    def _tensor(self, value: Any, what: str) -> Tensor:
        if value.__class__ is list and value:  # JSON's flat list of numbers, the common item: no NumPy
            fast = self._flat(value, what)
            if fast is not None:
                return fast
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as exc:
            raise MalformedPayload(f"Expected {what} as a rectangular array of numbers. "
                                   f"Received: {str(exc)[:120]}") from None
        if array.dtype.kind == "b" or array.dtype.kind not in "fiu" or array.size == 0 and what == "x":
            raise MalformedPayload(f"Expected {what} as a non-empty array of numbers. "
                                   f"Received: dtype {array.dtype}, shape {list(array.shape)}")
        if array.dtype.kind == "f":
            if not np.all(np.isfinite(array)):
                raise MalformedPayload(f"Expected finite numbers in {what}. Received: NaN or infinity")
            dtype = self.input_dtype if self.input_dtype.is_floating_point else torch.float32
            return torch.as_tensor(array).to(dtype)
        if what == "x" and self.input_dtype.is_floating_point:
            return torch.as_tensor(array).to(self.input_dtype)
        return torch.as_tensor(array.astype(np.int64))


    def _flat(self, values: list, what: str) -> Tensor | None:
        """A flat list of Python floats and ints as a tensor, as `_tensor` makes it (a float list
        in the input dtype, an int list of ``x`` too, of ``y`` as int64 class labels), without
        NumPy's per-call overhead (it was 25 of a JSON item's 28 us); None: not such a list."""
        has_float = False
        for v in values:
            kind = v.__class__
            if kind is float:
                if v - v != 0.0:  # NaN or infinity (json.loads takes them): the usual path says so
                    return None
                has_float = True
            elif kind is not int:
                return None
        floating = self.input_dtype.is_floating_point
        dtype = (self.input_dtype if floating else torch.float32) if has_float else (
            self.input_dtype if what == "x" and floating else torch.int64)
        try:
            code = _TYPECODES.get(dtype)
            if code is not None:  # through a Python array: a third of torch.tensor's time
                return torch.frombuffer(array.array(code, values), dtype=dtype)
            return torch.tensor(values, dtype=dtype)
        except (RuntimeError, OverflowError):  # an int beyond int64: the usual path says so
            return None


def encode_reply(prediction: Any, version: int, item_id: Hashable | None) -> bytes:
    """The JSON reply to one item."""
    return json.dumps({"id": item_id, "version": version, "prediction": _plain(prediction)},
                      separators=(",", ":")).encode()


def encode_outcome(future: Any, item_id: Hashable | None) -> bytes:
    """The JSON answer to one submitted item, from its finished future: the prediction
    (`encode_reply`), or ``{"id": ..., "error": "..."}`` when its step failed or was cancelled."""
    if future.cancelled():
        return json.dumps({"id": item_id, "error": "cancelled"}, separators=(",", ":")).encode()
    error = future.exception()
    return encode_answer(None if error is not None else future.result(), error, item_id)


def encode_answer(prediction: Any, error: BaseException | None, item_id: Hashable | None) -> bytes:
    """The JSON answer to one item: its prediction (`encode_reply`), or ``{"id": ..., "error": "..."}``."""
    if error is not None:
        return json.dumps({"id": item_id, "error": error_line(error)}, separators=(",", ":")).encode()
    return encode_reply(prediction.output, prediction.version, item_id)


def _plain(output: Any) -> Any:
    if isinstance(output, Tensor):
        return output.detach().cpu().tolist()
    if isinstance(output, Sequence):
        return [_plain(o) for o in output]
    return output


def _npy(payload: bytes) -> np.ndarray:
    try:
        return np.load(io.BytesIO(payload), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise MalformedPayload(f"Expected a readable .npy payload. Received: {type(exc).__name__}: "
                               f"{str(exc)[:120]}") from None


def _weight(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise MalformedPayload(f"Expected a weight >= 0. Received: {value!r}")
    return float(value)


def _item_id(value: Any) -> Hashable | None:
    if value is None:
        return None
    if isinstance(value, (bool, float)) or not isinstance(value, (str, int)) or len(str(value)) > MAX_ID_CHARS:
        raise MalformedPayload(f"Expected an id as a string or integer (at most {MAX_ID_CHARS} characters). "
                               f"Received: {str(value)[:40]!r}")
    return value


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(str(dtype).removeprefix("torch."))
