"""An endpoint's load, changed in one place: a :class:`Lease` adds one request (and its prompt
tokens, for prefillers) when taken and removes them exactly once when released; with the
goodput decision it also ends the call's :class:`~pd_router.costs.Job` then. Upstream
responses carry the lease of the call that opened them (``UpstreamClient.post(on_done=...)``):
releasing or closing the response gives it back, so no code path can leak or double-count.
No other module writes ``Endpoint.active`` or ``Endpoint.queued_tokens``."""

from __future__ import annotations

from pd_router.costs import Job
from pd_router.discovery import Endpoint


class Lease:
    __slots__ = ("ep", "job", "tokens")

    def __init__(self, ep: Endpoint, tokens: int = 0, job: Job | None = None) -> None:
        ep.active += 1
        ep.queued_tokens += tokens
        self.ep: Endpoint | None = ep
        self.tokens = tokens
        self.job = job

    def release(self) -> None:
        ep = self.ep
        if ep is not None:
            self.ep = None
            ep.active -= 1
            ep.queued_tokens -= self.tokens
            if self.job is not None:
                self.job.end()
