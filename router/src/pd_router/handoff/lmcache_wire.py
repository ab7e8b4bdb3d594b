"""Wire format of LMCache's PD proxy notification.

Checked against LMCache 0.5.6 (``lmcache/v1/storage_backend/pd_backend.py``): the sender
PUSHes ``msgspec.msgpack.encode(ProxyNotif(req_id=...))`` where ``ProxyNotif`` derives from
``PDMsgBase(msgspec.Struct, tag=True)``; for ``req_id="abc"`` that is the 28 bytes
``\\x82\\xa4type\\xaaProxyNotif\\xa6req_id\\xa3abc``. These are independent definitions that
produce/accept the same bytes; nothing is imported from LMCache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec


class PDMsgBase(msgspec.Struct, tag=True):
    """Base of LMCache's tagged PD messages (tag field ``type`` = class name)."""


class ProxyNotif(PDMsgBase):
    req_id: str


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ProxyNotif)


def encode_notif(req_id: str) -> bytes:
    return _encoder.encode(ProxyNotif(req_id=req_id))


def decode_notif(data: bytes) -> str:
    """Return the req_id of a ProxyNotif; raises ValueError for anything else."""
    try:
        return _decoder.decode(data).req_id
    except Exception as exc:  # msgspec raises DecodeError, ValidationError, UnicodeDecodeError
        raise ValueError(f"not a ProxyNotif: {exc}") from exc


class _Counter(Protocol):
    def inc(self) -> None: ...


async def receive_notifications(
    sock: Any, on_req_id: Callable[[str], None], malformed: _Counter
) -> None:
    """Forever: read ProxyNotif messages from a ZMQ PULL socket (zmq.asyncio) and hand on each
    request id; undecodable messages are counted and dropped. Shared by the router's receiver and
    the prefill-side notification sidecar."""
    while True:
        data = await sock.recv()
        try:
            req_id = decode_notif(data)
        except ValueError:
            malformed.inc()
            continue
        on_req_id(req_id)
