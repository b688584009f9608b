"""The load's HTTP client: keep-alive HTTP/1.1 connections driven by h11 on asyncio streams."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from urllib.parse import urlsplit


class _Connection:
    """One HTTP/1.1 keep-alive connection: h11's state machine over asyncio streams.

    The load loop's hot path. httpx (used for the metadata query) spends 1-2.5 ms of
    client CPU per request here, measured against a trivial server on 2 cores, which
    caps a one-process load generator below what a batching server sustains; h11
    alone (the HTTP/1.1 parser httpx itself uses) spends about 0.2 ms.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        import h11

        self._h11 = h11
        self.reader, self.writer, self.host = reader, writer, host
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, host: str, port: int, tls: bool, host_header: str) -> _Connection:
        reader, writer = await asyncio.open_connection(host, port, ssl=True if tls else None)
        sock = writer.get_extra_info("socket")
        if sock is not None:  # never let Nagle hold a request back waiting for an ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, host_header)

    def reusable(self) -> bool:
        return (self.conn.our_state is self._h11.IDLE and not self.reader.at_eof()
                and not self.writer.is_closing())

    async def post(self, target: str, body: bytes, headers: dict[str, str],
                   on_data: Callable[[bytes], None] | None = None) -> tuple[int, dict[str, str], bytes]:
        h11 = self._h11
        head = [("Host", self.host), ("Content-Length", str(len(body))), *headers.items()]
        self.writer.write(self.conn.send(h11.Request(method="POST", target=target, headers=head))
                          + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage()))
        status, response_headers, chunks = 0, {}, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                data = await self.reader.read(1 << 16)
                self.conn.receive_data(data)  # b"" = the server closed: h11 raises if mid-answer
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                response_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                if on_data is not None and status == 200:
                    on_data(bytes(event.data))  # a stream: each piece as it arrives
                else:
                    chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection without an answer")
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return status, response_headers, b"".join(chunks)

    def close(self) -> None:
        self.writer.close()


class ConnectionPool:
    """At most ``size`` connections to one server; each request takes an idle one or opens one.

    A connection that fails or is interrupted (timeout, cancellation) mid-request is
    closed, never reused: its next answer could belong to the abandoned request.
    """

    def __init__(self, base: str, size: int, headers: dict[str, str] | None = None):
        parts = urlsplit(base)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.tls else 80)
        self.host_header = parts.netloc
        self.prefix = parts.path.rstrip("/")
        self.headers = dict(headers or {})
        self._slots = asyncio.Semaphore(size)
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes, headers: dict[str, str],
                   on_data: Callable[[bytes], None] | None = None) -> tuple[int, dict[str, str], bytes]:
        """Status, headers and body of one POST. With ``on_data``, a 200 answer's body goes to
        ``on_data`` piece by piece as it arrives (a stream of server-sent events) instead."""
        async with self._slots:
            conn = None
            while self._idle and conn is None:
                candidate = self._idle.pop()
                if candidate.reusable():
                    conn = candidate
                else:
                    candidate.close()
            if conn is None:
                conn = await _Connection.open(self.host, self.port, self.tls, self.host_header)
            try:
                result = await conn.post(self.prefix + path, body, {**self.headers, **headers}, on_data)
            except BaseException:
                conn.close()
                raise
            if conn.reusable():
                self._idle.append(conn)
            else:
                conn.close()
            return result

    async def aclose(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def __aenter__(self) -> ConnectionPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
