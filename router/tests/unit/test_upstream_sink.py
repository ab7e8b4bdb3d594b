"""``upstream.Response``'s sink mode (the stream relay without a task wake-up per chunk,
pd_router.legs ``_relay_sunk``), fed bytes as an engine's socket would deliver them: the chunks
of one read reach the sink as one piece, before the end is seen; a sink removed mid-read leaves
the rest buffered for the next; a sink that raises fails the response with its own error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pd_router.upstream import Response, _Conn, _HostPool

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Transport:
    def __init__(self) -> None:
        self.closed = False
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return self.closed


def _response() -> tuple[_Conn, Response, _Transport]:
    conn = _Conn(_HostPool("127.0.0.1", 9, False))
    t = _Transport()
    conn.connection_made(t)  # type: ignore[arg-type]
    resp = Response(conn, idle=5.0)
    conn.resp = resp
    conn.data_received(HEAD)
    assert resp.status == 200
    return conn, resp, t


def test_the_last_chunk_reaches_the_sink_before_the_end_is_seen() -> None:
    async def main() -> tuple[list[bytes], bool]:
        conn, resp, _ = _response()
        got: list[bytes] = []
        resp.sink(got.append)
        conn.data_received(_chunk(b"data: 1\n\n"))
        # the last read comes while the relay waits on the response: the body and the end at once
        last = _chunk(b"data: 2\n\n") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        asyncio.get_running_loop().call_soon(conn.data_received, last)
        return got, await resp.sink_wait()

    got, done = asyncio.run(main())
    assert got == [b"data: 1\n\n", b"data: 2\n\ndata: [DONE]\n\n"]  # one piece per read
    assert done


def test_a_sink_removed_mid_read_leaves_the_rest_for_the_next() -> None:
    async def main() -> tuple[list[bytes], bool, bool]:
        conn, resp, _ = _response()
        got: list[bytes] = []

        def behind(data: bytes) -> None:
            got.append(data)
            resp.unsink()  # the client fell behind

        resp.sink(behind)
        conn.data_received(_chunk(b"data: 1\n\n"))
        conn.data_received(_chunk(b"data: 2\n\n"))  # buffered: no sink
        first = await resp.sink_wait()
        conn.data_received(b"0\r\n\r\n")
        resp.sink(got.append)  # its writes drained: what waited goes first
        return got, first, await resp.sink_wait()

    got, first, done = asyncio.run(main())
    assert (got, first, done) == ([b"data: 1\n\n", b"data: 2\n\n"], False, True)


def test_a_sink_that_raises_fails_the_response_with_its_own_error() -> None:
    class Bug(Exception):
        pass

    def broken(data: bytes) -> None:
        raise Bug("a bug in the relay")

    async def main() -> tuple[Any, _Transport]:
        conn, resp, t = _response()
        resp.sink(broken)
        conn.data_received(_chunk(b"data: 1\n\n"))  # no exception out of the protocol
        with pytest.raises(Bug):
            await resp.sink_wait()
        return resp, t

    _, t = asyncio.run(main())
    assert t.closed  # the engine's connection is dropped: the request ends there
