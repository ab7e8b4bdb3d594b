"""A reverse proxy in front of a real prefiller that breaks the NIXL hand-off on request, the way
a deployment breaks it: ``python -m tests.real_engine.tamper --upstream URL --port-file F``.

``POST /tamper {"mode": M, "count": N}`` arms the next N prefill answers (-1: all):
- ``pass``: relayed as they are;
- ``wrong_port``: ``kv_transfer_params`` name a side-channel port nothing listens on (and a
  prefiller the decoder never met, so it cannot reuse an earlier handshake): what a decoder sees
  when a NetworkPolicy or a wrong ``VLLM_NIXL_SIDE_CHANNEL_PORT`` blocks the side channel. One
  port and engine id per arming, as one prefiller's answers all name its one engine id: vLLM
  0.31's requests waiting on one engine id share one handshake, where an id per answer would be
  a new prefiller each time, each its own 5 s handshake in turn on the decoder's one handshake
  thread (``nixl/base_worker.py``: ``_ensure_handshake``, ``max_workers=1``);
- ``kill``: the prefiller's whole process group is killed after it answered and before the
  router gets that answer, so the decoder is told to pull KV from a prefiller that is gone.
Everything else (health checks, /metrics) passes through unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import uuid
from pathlib import Path

import aiohttp
from aiohttp import web


def closed_port() -> int:
    with socket.socket() as s:  # bound and closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Tamper:
    def __init__(self, upstream: str, pgid: int | None) -> None:
        self.upstream = upstream.rstrip("/")
        self.pgid = pgid
        self.mode, self.count = "pass", 0
        self.blocked = (0, "")  # wrong_port's (port, engine id), chosen at each arming
        self.session: aiohttp.ClientSession | None = None
        self.done: dict[str, int] = {}

    async def arm(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.mode, self.count = body["mode"], int(body.get("count", -1))
        self.blocked = (closed_port(), str(uuid.uuid4()))
        return web.json_response({"mode": self.mode, "count": self.count, "done": self.done})

    def _take(self) -> str:
        if self.mode == "pass" or self.count == 0:
            return "pass"
        if self.count > 0:
            self.count -= 1
        return self.mode

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        data = await request.read()
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("content-type", "x-request-id", "authorization", "traceparent", "tracestate")
        }
        timeout = aiohttp.ClientTimeout(total=300)
        async with self.session.request(
            request.method, self.upstream + request.path_qs, data=data, headers=headers, timeout=timeout
        ) as r:
            raw = await r.read()
            ctype = r.headers.get("Content-Type", "application/json")
            status = r.status
        mode = self._take() if request.method == "POST" and b"do_remote_decode" in data else "pass"
        if mode != "pass" and status == 200:
            self.done[mode] = self.done.get(mode, 0) + 1
            if mode == "wrong_port":
                answer = json.loads(raw)
                kv = answer["kv_transfer_params"]
                kv["remote_port"], kv["remote_engine_id"] = self.blocked
                raw = json.dumps(answer).encode()
            elif mode == "kill" and self.pgid:
                os.killpg(self.pgid, signal.SIGKILL)
        return web.Response(status=status, body=raw, headers={"Content-Type": ctype})


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", required=True)
    p.add_argument("--kill-pgid", type=int)
    p.add_argument("--port-file", required=True)
    a = p.parse_args()
    t = Tamper(a.upstream, a.kill_pgid)
    t.session = aiohttp.ClientSession()
    app = web.Application()
    app.router.add_post("/tamper", t.arm)
    app.router.add_route("*", "/{tail:.*}", t.proxy)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    Path(a.port_file).write_text(str(port))
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
