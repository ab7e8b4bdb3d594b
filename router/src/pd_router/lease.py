"""An endpoint's load, changed in one place: a :class:`Lease` adds one request (and its prompt
tokens, for prefillers) when taken and removes them exactly once when released. Upstream
responses carry the lease of the call that opened them (``UpstreamClient.post(on_done=...)``):
releasing or closing the response gives it back, so no code path can leak or double-count.
No other module writes ``Endpoint.active`` or ``Endpoint.queued_tokens``."""

from __future__ import annotations

from pd_router.discovery import Endpoint


class Lease:
    __slots__ = ("ep", "tokens")

    def __init__(self, ep: Endpoint, tokens: int = 0) -> None:
        ep.active += 1
        ep.queued_tokens += tokens
        self.ep: Endpoint | None = ep
        self.tokens = tokens

    def release(self) -> None:
        ep = self.ep
        if ep is not None:
            self.ep = None
            ep.active -= 1
            ep.queued_tokens -= self.tokens
