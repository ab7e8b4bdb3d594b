"""Sending a workload through a router and timing every token at the client: open-loop
Poisson arrivals (a request is sent at its time whatever the others are doing), chat sessions
whose next turn follows the previous answer. Every network call has a deadline."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pd_router_dev.goodput.workload import Request, Session, chat_request, unshared

REQUEST_SECONDS = 300.0  # one request, stream included: past it the request counts as failed


@dataclass
class Record:
    """One request as the client saw it (times in seconds from the cell's start)."""

    at: float
    long: bool
    phase: str = ""
    session: int = -1
    turn: int = 0
    ok: bool = False
    error: str = ""
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    route: str = ""
    reason: str = ""
    predicted_ttft: float | None = None  # from x-pd-predicted (the goodput decision only)
    predicted_misses: float | None = None
    predicted_held_up: float | None = None  # of those misses, the arrivals its prefill holds up
    rid: str = ""  # its X-Request-Id (the router's access line names its engines by it)
    engine: str = ""  # the engine that answered, and the one that prefilled (access line)
    prefiller: str = ""
    answer: str = ""  # a chat turn's text, for the next turn

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("gaps", "answer")}
        d["itl_p95"] = self.itl_p95()
        return d

    def itl_p95(self) -> float:
        """Nearest-rank 95th percentile of its inter-token gaps (0 with fewer than two
        tokens): at most 5 % of the gaps lie above it, the budget the router plans with."""
        if not self.gaps:
            return 0.0
        g = sorted(self.gaps)
        return g[max(0, -(-95 * len(g) // 100) - 1)]


def _predicted(header: str, key: str = "ttft_ms", scale: float = 1000) -> float | None:
    for part in header.split(";"):
        k, _, v = part.strip().partition("=")
        if k == key:
            try:
                return float(v) / scale
            except ValueError:
                return None
    return None


async def send(
    session: aiohttp.ClientSession, base: str, req: Request, t0: float, rid: str = ""
) -> Record:
    rec = Record(req.at, req.long, req.phase, req.session, req.turn, rid=rid)
    chat = req.path.endswith("chat/completions")
    start = time.perf_counter()
    last = 0.0
    parts: list[str] = []
    try:
        async with asyncio.timeout(REQUEST_SECONDS):
            async with session.post(
                base + req.path,
                data=orjson.dumps(req.body),
                headers={
                    "Content-Type": "application/json",
                    **({"X-Request-Id": rid} if rid else {}),
                },
            ) as r:
                rec.route = r.headers.get("x-pd-route", "")
                rec.reason = r.headers.get("x-pd-reason", "")
                pred = r.headers.get("x-pd-predicted", "")
                rec.predicted_ttft = _predicted(pred)
                rec.predicted_misses = _predicted(pred, "misses", 1)
                rec.predicted_held_up = _predicted(pred, "held_up", 1)
                if r.status != 200:
                    rec.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                    return rec
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        rec.ok = rec.ttft is not None
                        break
                    ev = orjson.loads(payload)
                    if ev.get("usage"):
                        rec.prompt_tokens = ev["usage"].get("prompt_tokens", 0)
                        rec.output_tokens = ev["usage"].get("completion_tokens", 0)
                    if "error" in ev:
                        rec.error = str(ev["error"])[:200]
                        break
                    for ch in ev.get("choices") or ():
                        now = time.perf_counter()
                        if rec.ttft is None:
                            rec.ttft = now - start
                        else:
                            rec.gaps.append(now - last)
                        last = now
                        if chat:
                            parts.append((ch.get("delta") or {}).get("content") or "")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        rec.error = repr(exc)[:200]
        rec.ok = False
    rec.answer = "".join(parts)
    return rec


async def _session(
    http: aiohttp.ClientSession,
    base: str,
    s: Session,
    model: str,
    t0: float,
    out: list[Record],
    tag: str,
) -> None:
    at = s.at
    for turn in range(len(s.turns)):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # the session's schedule, not a synchronisation
        req = chat_request(s, turn, model, at)
        rid = f"{tag}-s{s.index}-{turn}".replace(" ", "-")
        rec = await send(http, base, unshared(req, tag) if tag else req, t0, rid)
        out.append(rec)
        if not rec.ok:
            return  # a conversation stops at a failed turn
        s.messages.append({"role": "assistant", "content": rec.answer})
        at = time.perf_counter() - t0 + s.think


async def drive(
    base: str,
    requests: list[Request],
    chats: list[Session] = (),
    model: str = "",
    tag: str = "",
) -> list[Record]:
    """Send every request at its time and every chat session's turns in order; the records
    of all of them, once the last one ended. ``tag``: each prompt made the configuration's own
    (workload.unshared)."""
    out: list[Record] = []
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        t0 = time.perf_counter()

        async def at(req: Request, i: int) -> None:
            delay = t0 + req.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule, not a synchronisation
            rid = f"{tag}-{i}".replace(" ", "-")
            out.append(await send(http, base, unshared(req, tag) if tag else req, t0, rid))

        tasks = [asyncio.create_task(at(r, i)) for i, r in enumerate(requests)]
        tasks += [asyncio.create_task(_session(http, base, s, model, t0, out, tag)) for s in chats]
        await asyncio.gather(*tasks)
    return out


async def closed_loop(base: str, make: Any, clients: int, seconds: float) -> float:
    """Requests completed per second by ``clients`` clients each sending ``make(i)``'s request
    as soon as its last one ended, for ``seconds`` (the capacity of what answers at ``base``)."""
    done = 0
    stop = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=None)
    ) as http:

        async def loop(k: int) -> None:
            nonlocal done
            i = k
            while time.perf_counter() < stop:
                rec = await send(http, base, make(i), 0.0)
                if rec.ok and time.perf_counter() <= stop:
                    done += 1
                i += clients

        await asyncio.gather(*(loop(k) for k in range(clients)))
        return done / seconds
