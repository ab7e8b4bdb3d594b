"""The one failure type of an upstream leg, classified once where the failure happens.

Every leg (decoder, prefiller) raises :class:`LegError`; its ``kind`` is the
``pd_router_upstream_errors_total`` label and its ``status`` what the client gets when no other
engine can take over (504 for a timeout, 502 for a broken connection or answer, 503 when no
decoder is left, the engine's own status for a 5xx).
"""

from __future__ import annotations

from typing import Literal

import aiohttp

# What a call to an engine can raise (the lean client's UpstreamError is an OSError).
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, OSError)

# "revision": the engine refused the KV revision's model name it was sent (pd_router.revision);
# "abandoned": a hand-off given up because another one on its pair failed (pd_router.pairs)
Kind = Literal[
    "connect", "timeout", "5xx", "stream", "bad_response", "no_decoder", "revision", "abandoned"
]


class LegError(Exception):
    __slots__ = ("answered", "body", "ctype", "kind", "status")

    def __init__(
        self,
        kind: Kind,
        status: int,
        body: bytes | None = None,
        ctype: str = "",
        answered: bool = False,
    ) -> None:
        super().__init__(kind, status)
        self.kind = kind
        self.status = status
        self.body = body  # an engine's own 5xx answer, passed on when nothing else could serve
        self.ctype = ctype
        # the engine answered, all of it: a 5xx, or a stream that ended before its first token
        # (how vLLM fails a decode whose KV load failed), not a connection or a clock that ran out
        self.answered = answered or kind == "5xx"

    @classmethod
    def of(cls, exc: BaseException, otherwise: Kind = "connect") -> LegError:
        """Classify a transport exception: a timeout, else ``otherwise`` (connect / stream)."""
        return cls("timeout", 504) if isinstance(exc, TimeoutError) else cls(otherwise, 502)

    @classmethod
    def no_decoder(cls) -> LegError:
        return cls("no_decoder", 503)


class TokenizeError(Exception):
    """An engine's /tokenize gave no usable answer (or no engine was there to ask)."""
