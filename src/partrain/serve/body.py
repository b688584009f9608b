"""Request bodies: the size limit and ``Content-Encoding`` (gzip), with no HTTP framework in here.

A client may compress a request body with gzip (``Content-Encoding: gzip``, as
Triton's clients do with ``request_compression_algorithm="gzip"``). The body is
decompressed as it arrives, and the *decompressed* size is bounded by the same
limit as an uncompressed body, so a small compressed body cannot expand into
gigabytes (a "zip bomb") before anything checks it. Headers that refer to the
body (``Inference-Header-Content-Length``) count bytes of the decompressed body.

Errors are `ProtocolError` lines: 413 beyond the limit (compressed or not), 400
for a body that is not valid gzip, 415 for any other encoding (with an
``Accept-Encoding`` header naming what is accepted, as RFC 7694 suggests).
"""

from __future__ import annotations

import zlib

from .protocol import ProtocolError

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # largest request body accepted, else 413
ACCEPTED_ENCODINGS = "gzip"  # the Accept-Encoding value of a 415 answer
_GZIP = ("gzip", "x-gzip")  # RFC 9110: x-gzip is gzip
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib: expect a gzip header and trailer


def _too_large(limit: int, what: str) -> ProtocolError:
    return ProtocolError(f"Expected a body of at most {limit} bytes. Received: {what}", 413)


class BodyDecoder:
    """Collects a body that arrives in chunks; bounded by ``limit`` bytes (decoded).

    ``feed(chunk)`` for each chunk as it arrives, then ``finish()`` for the body.
    This class is the identity encoding; `GzipDecoder` decompresses.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.size = 0  # decoded bytes so far
        self.received = 0  # bytes on the wire so far
        self._parts: list[bytes] = []

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.limit:
            raise _too_large(self.limit, "more")
        self._keep(chunk)

    def _keep(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise _too_large(self.limit, f"more once decompressed (from {self.received} gzip bytes so far)")
        self._parts.append(data)

    def finish(self) -> bytes:
        return b"".join(self._parts)


class GzipDecoder(BodyDecoder):
    """A gzip body (one or more concatenated members, RFC 1952), decompressed as it arrives."""

    def __init__(self, limit: int):
        super().__init__(limit)
        self._member = zlib.decompressobj(_GZIP_WBITS)
        self._started = False

    def feed(self, chunk: bytes) -> None:
        self.received += len(chunk)
        if self.received > self.limit:
            raise _too_large(self.limit, "more")
        data = chunk
        while data:
            if self._member.eof:  # the previous member ended: the rest is the next member
                self._member = zlib.decompressobj(_GZIP_WBITS)
            self._started = True
            try:
                # never more than one byte past the limit, however well the data compresses
                piece = self._member.decompress(data, self.limit - self.size + 1)
            except zlib.error as exc:
                raise ProtocolError(f"Expected a gzip body, as its 'Content-Encoding: gzip' says. "
                                    f"Received: bytes that are not gzip ({exc})", 400) from None
            self._keep(piece)
            data = self._member.unused_data if self._member.eof else self._member.unconsumed_tail

    def finish(self) -> bytes:
        if not self._started:
            raise ProtocolError("Expected a gzip body, as its 'Content-Encoding: gzip' says. "
                                "Received: an empty body", 400)
        if not self._member.eof:
            raise ProtocolError("Expected a complete gzip body, as its 'Content-Encoding: gzip' says. "
                                f"Received: a gzip stream cut short after {self.received} bytes", 400)
        return super().finish()


def body_decoder(content_encoding: str | None, limit: int) -> BodyDecoder:
    """The decoder for a request's ``Content-Encoding`` header (None or ``identity``: as is).

    Raises `ProtocolError` 415 for an encoding other than gzip and identity (a
    list such as ``gzip, br`` included: one gzip layer at most).
    """
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return BodyDecoder(limit)
    if len(codings) == 1 and codings[0] in _GZIP:
        return GzipDecoder(limit)
    raise ProtocolError(f"Expected Content-Encoding gzip or identity (or none). "
                        f"Received: Content-Encoding {content_encoding!r}", 415,
                        headers={"Accept-Encoding": ACCEPTED_ENCODINGS})
