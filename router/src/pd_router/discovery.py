"""Endpoint pools: static or DNS discovery (headless Service of a StatefulSet, re-resolved
periodically), active health checks with thresholds and passive ejection, and what each engine
says of itself, read each time it comes up healthy, before it takes requests: its KV cache
(pd_router.cache_info), its KV-compatibility revision (pd_router.revision) and which weights it
holds (pd_router.weights)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
import orjson

from pd_router import adapters, cache_info, kv_events, revision, weights
from pd_router.cache_info import CacheInfo
from pd_router.config import Health, KvEvents, Pool

log = logging.getLogger("pd_router.discovery")

# Lookups in a row that must find no such name before a DNS pool is emptied (discover_once).
EMPTY_AFTER_NXDOMAIN = 2
# getaddrinfo's answers for a name without an address (NXDOMAIN, or NODATA: the name without
# an A/AAAA record), not a failed lookup.
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def _no_such_name(exc: OSError) -> bool:
    return isinstance(exc, socket.gaierror) and exc.errno in _NO_SUCH_NAME


class Endpoint:
    __slots__ = (
        "active",
        "adapters",
        "base",
        "cache",
        "consec_bad",
        "consec_ok",
        "ejected_until",
        "ejections",
        "events",
        "generation",
        "healthy",
        "host",
        "learnt",
        "passive_failures",
        "port",
        "queued_tokens",
        "removed",
        "revision",
        "tls",
        "weights",
    )

    def __init__(self, base: str) -> None:
        self.base = base.rstrip("/")
        u = urlsplit(self.base)
        self.host = u.hostname or ""
        self.tls = u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.active = 0  # requests / streams in flight through this router
        self.queued_tokens = 0  # prompt tokens sent and not yet answered (prefillers)
        self.healthy = False
        self.consec_ok = 0
        self.consec_bad = 0
        self.passive_failures = 0
        self.ejections = 0  # passive ejections in a row (reset by a request served well)
        self.ejected_until = 0.0  # monotonic time before which no active check re-admits it
        self.removed = False
        # Bumped each time the endpoint becomes healthy: it may have restarted meanwhile, with
        # an empty KV cache (the prefix index starts its picture of it afresh).
        self.generation = 0
        self.cache: CacheInfo | None = None  # what it said of its KV cache (vllm:cache_config_info)
        # its KV-compatibility revision (pd_router.revision): None = not known, pairs with none
        self.revision: str | None = None
        # its revision's weight set (pd_router.weights): None = not known, pairs with none
        self.weights: int | None = 0
        # the LoRA adapters its /v1/models lists, each with the path it loaded it from
        # (pd_router.adapters), read with its revision
        self.adapters: dict[str, str] = {}
        # where it publishes its KV events (pd_router.kv_events), when it does and may be heard
        self.events: kv_events.Source | None = None
        # whether cache and revision were read since it last went down (or was refused)
        self.learnt = False

    def __repr__(self) -> str:
        return f"Endpoint({self.base}, healthy={self.healthy}, active={self.active})"

    @property
    def pairing(self) -> str | None:
        """What a prefiller and a decoder must share to be paired: one KV revision and one
        weight set of it (None: either not known, pairs with nothing)."""
        if self.revision is None or self.weights is None:
            return None
        return self.revision if not self.weights else f"{self.revision}~{self.weights}"


class EndpointPool:
    def __init__(
        self,
        name: str,
        cfg: Pool,
        health: Health,
        on_change: Callable[[EndpointPool], None] | None = None,
        served: str = "",
        kv: KvEvents | None = None,
        weight_sets: weights.WeightSets | None = None,
    ) -> None:
        self.name = name
        # the router's weight sets (pd_router.weights), None when health.weightsCheck is off
        self.weight_sets = weight_sets
        self.kv = kv if kv is not None and kv.enabled else None  # routing.kvEvents
        self.served = served  # model.servedName: the name its revision's name starts with
        self.cfg = cfg
        self.health = health
        self.endpoints: dict[str, Endpoint] = {}
        self.healthy: list[Endpoint] = []
        self.on_change = on_change
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._no_such_name = 0  # DNS lookups in a row that found no such name

    # ------------------------------------------------------------------ state changes
    def _refresh_healthy(self) -> None:
        self.healthy = [e for e in self.endpoints.values() if e.healthy]
        if self.on_change:
            self.on_change(self)

    def set_endpoints(self, bases: list[str]) -> list[Endpoint]:
        """Replace the endpoint set; returns the new endpoints (they start unhealthy)."""
        wanted = {b.rstrip("/") for b in bases}
        added = []
        for base in wanted - self.endpoints.keys():
            ep = Endpoint(base)
            self.endpoints[base] = ep
            added.append(ep)
        gone = self.endpoints.keys() - wanted
        for base in gone:
            self.endpoints.pop(base).removed = True
        if added or gone:
            log.info("pool %s endpoints: %s", self.name, sorted(self.endpoints))
        self._refresh_healthy()
        return added

    def report_failure(self, ep: Endpoint) -> None:
        ep.passive_failures += 1
        if ep.healthy and ep.passive_failures >= self.health.passive_failure_threshold:
            self.eject(ep, f"after {ep.passive_failures} failures")

    def eject(self, ep: Endpoint, why: str) -> None:
        """Take ``ep`` out now for ``health.ejectionSeconds``, doubled with each ejection in a
        row (up to ``maxEjectionSeconds``); its checks re-admit it after that."""
        h = self.health
        was = ep.healthy
        ep.healthy = False
        ep.consec_ok = 0
        ep.ejections += 1
        out = h.ejection_for(ep.ejections)
        ep.ejected_until = time.monotonic() + out
        ep.learnt = False  # it may come back restarted
        log.warning(
            "pool %s: ejected %s %s for %.0f s (ejection %d in a row)",
            self.name,
            ep.base,
            why,
            out,
            ep.ejections,
        )
        if was:
            self._refresh_healthy()

    def relearn(self, ep: Endpoint) -> None:
        """``ep`` refused its revision's name: it restarted on other bits since it was asked.
        It pairs with nothing until its next health check asks it again."""
        if ep.revision is not None:
            log.warning("pool %s: %s no longer serves revision %r", self.name, ep.base, ep.revision)
        ep.revision = None
        ep.learnt = False
        self._refresh_healthy()

    def report_success(self, ep: Endpoint) -> None:
        if ep.passive_failures or ep.ejections:
            ep.passive_failures = 0
            ep.ejections = 0

    def _record_check(self, ep: Endpoint, ok: bool) -> None:
        h = self.health
        if ok:
            ep.consec_ok += 1
            ep.consec_bad = 0
            if (
                not ep.healthy
                and ep.consec_ok >= h.healthy_threshold
                and time.monotonic() >= ep.ejected_until
            ):
                ep.healthy = True
                ep.passive_failures = 0
                ep.generation += 1
                log.info("pool %s: %s is healthy", self.name, ep.base)
                self._refresh_healthy()
        else:
            ep.consec_bad += 1
            ep.consec_ok = 0
            ep.learnt = False  # whatever answers next may be another process
            if ep.healthy and ep.consec_bad >= h.unhealthy_threshold:
                ep.healthy = False
                log.warning(
                    "pool %s: %s failed %d health checks", self.name, ep.base, ep.consec_bad
                )
                self._refresh_healthy()

    # ------------------------------------------------------------------ active checks
    async def probe(self, ep: Endpoint) -> bool:
        """Whether ``ep`` answers its health check (``health.path``, 200) within
        ``health.timeoutSeconds``."""
        assert self._session is not None
        try:
            async with asyncio.timeout(self.health.timeout_seconds):
                async with self._session.get(ep.base + self.health.path) as resp:
                    await resp.read()
                    return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _check(self, ep: Endpoint) -> None:
        ok = await self.probe(ep)
        if ok and not ep.learnt and not ep.removed:
            # before it is admitted: a request must not see it with last life's revision
            await self._learn(ep)
        if not ep.removed:
            self._record_check(ep, ok)

    async def _learn(self, ep: Endpoint) -> None:
        """Read what the engine says of itself: ``vllm:cache_config_info`` (None: it does not
        say, and the router claims none of its cache) and its revision (None: its
        ``/v1/models`` did not answer, and it pairs with nothing; asked again next check)."""
        cache, (rev, listed), events, fp = await asyncio.gather(
            self._ask_cache(ep),
            self._ask_models(ep),
            self._ask_kv_events(ep),
            self._ask_weights(ep),
        )
        if ep.removed:
            return
        ep.cache = cache
        ep.events = events
        if cache is None:
            log.info("pool %s: %s tells nothing of its KV cache", self.name, ep.base)
        was = ep.pairing
        changed = rev != ep.revision or listed != ep.adapters
        ep.revision = rev
        ep.adapters = listed
        ep.weights = self._place(ep, rev, fp)
        ep.learnt = rev is not None and ep.weights is not None
        if changed:
            log.info(
                "pool %s: %s serves KV revision %r, LoRA adapters %s",
                self.name,
                ep.base,
                rev,
                sorted(listed) or "none",
            )
        if (changed or ep.pairing != was) and ep.healthy:
            self._refresh_healthy()

    def _place(self, ep: Endpoint, rev: str | None, fp: weights.Fingerprint | None) -> int | None:
        """``ep``'s weight set in its revision (0 with the check off)."""
        sets = self.weight_sets
        if sets is None:
            return 0
        if rev is None or fp is None:
            return None
        index, first = sets.place(rev, ep.base, fp)
        if index:  # not set 0: name both engines, with what each answered
            log.warning(
                "pool %s: %s holds other weights than %s under KV revision %r (probe answered "
                "%s against %s): paired only with engines of its own weights",
                self.name,
                ep.base,
                first,
                rev,
                fp,
                sets.first(rev, 0),
            )
        elif index is None:
            log.warning(
                "pool %s: %s holds yet other weights under KV revision %r (more than %d sets): "
                "paired with nothing",
                self.name,
                ep.base,
                rev,
                weights.MAX_SETS,
            )
        return index

    async def _ask_weights(self, ep: Endpoint) -> weights.Fingerprint | None:
        """Its answer to the weights probe (pd_router.weights); None when the check is off or
        it did not answer one (asked again next check)."""
        if self.weight_sets is None:
            return None
        assert self._session is not None
        body = orjson.dumps(weights.probe_body(self.served))
        try:
            async with asyncio.timeout(max(self.health.timeout_seconds, weights.PROBE_SECONDS)):
                async with self._session.post(
                    ep.base + "/v1/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                ) as resp:
                    text = await resp.read()
                    if resp.status != 200:
                        log.warning(
                            "pool %s: %s weights probe answered %d", self.name, ep.base, resp.status
                        )
                        return None
                    return weights.from_answer(orjson.loads(text))
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("pool %s: %s weights probe failed: %r", self.name, ep.base, exc)
        except ValueError as exc:  # orjson's error is one too
            log.warning("pool %s: %s weights probe: %s", self.name, ep.base, exc)
        return None

    async def _ask_cache(self, ep: Endpoint) -> CacheInfo | None:
        assert self._session is not None
        try:
            async with asyncio.timeout(self.health.timeout_seconds):
                async with self._session.get(ep.base + "/metrics") as resp:
                    if resp.status == 200:
                        return cache_info.parse(await resp.text())
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            pass
        return None

    async def _ask_kv_events(self, ep: Endpoint) -> kv_events.Source | None:
        """Its KV-event publisher (``GET /kv_event_sources``, vLLM 0.31.0), checked against
        routing.kvEvents; None (the approximate index) when off, absent or elsewhere."""
        if self.kv is None:
            return None
        assert self._session is not None
        try:
            async with asyncio.timeout(self.health.timeout_seconds):
                async with self._session.get(ep.base + "/kv_event_sources") as resp:
                    if resp.status != 200:
                        return None  # not vLLM, or an older one: nothing to hear
                    src, why = kv_events.source_of(
                        orjson.loads(await resp.read()), ep.host, self.kv
                    )
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        if src is None:
            log.warning("pool %s: %s %s: approximate prefix index", self.name, ep.base, why)
        return src

    async def _ask_models(self, ep: Endpoint) -> tuple[str | None, dict[str, str]]:
        """(its revision, its LoRA adapters) from its ``/v1/models`` (revision None: no
        answer, asked again next check)."""
        assert self._session is not None
        none: dict[str, str] = {}
        try:
            async with asyncio.timeout(self.health.timeout_seconds):
                async with self._session.get(ep.base + "/v1/models") as resp:
                    if resp.status == 404:  # no models list: not vLLM, names no revision
                        return revision.NONE, none
                    if resp.status != 200:
                        log.warning(
                            "pool %s: %s/v1/models answered %d", self.name, ep.base, resp.status
                        )
                        return None, none
                    answer = orjson.loads(await resp.read())
                    rev = revision.from_models(answer, self.served)
                    return rev, adapters.listed(answer, self.served)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("pool %s: %s/v1/models failed: %r", self.name, ep.base, exc)
        except ValueError as exc:  # orjson's error is one too
            log.warning("pool %s: %s/v1/models: %s", self.name, ep.base, exc)
        return None, none

    async def check_all(self, eps: list[Endpoint] | None = None) -> None:
        eps = list(self.endpoints.values()) if eps is None else eps
        if eps:
            await asyncio.gather(*(self._check(e) for e in eps))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health.interval_seconds)
            with contextlib.suppress(Exception):
                await self.check_all()

    # ------------------------------------------------------------------ discovery
    async def resolve(self) -> list[str]:
        if self.cfg.discovery == "static":
            return list(self.cfg.static)
        d = self.cfg.dns
        loop = asyncio.get_running_loop()
        # bounded like every other outside call (TimeoutError is an OSError: last set kept)
        async with asyncio.timeout(max(2.0, d.refresh_seconds)):
            infos = await loop.getaddrinfo(d.name, d.port, type=socket.SOCK_STREAM)
        bases = set()
        for family, _, _, _, addr in infos:
            ip = addr[0]
            bases.add(
                f"http://[{ip}]:{d.port}" if family == socket.AF_INET6 else f"http://{ip}:{d.port}"
            )
        return sorted(bases)

    async def discover_once(self) -> None:
        try:
            bases = await self.resolve()
        except OSError as exc:
            if not _no_such_name(exc):
                # Keep the last known set on other DNS errors: a blip must not empty the pool.
                self._no_such_name = 0  # (and NXDOMAIN is believed twice in a row only)
                log.warning(
                    "pool %s: DNS lookup of %s failed: %s", self.name, self.cfg.dns.name, exc
                )
                return
            # A headless Service with no ready endpoint answers NXDOMAIN (the Kubernetes DNS
            # spec since kubernetes/dns PR 245): the pool scaled to zero, or every pod not
            # ready. Believed at the second answer in a row, so one stray NXDOMAIN (CoreDNS
            # issue 6518) does not empty a pool; until then the set, and the checks, stay.
            self._no_such_name += 1
            if self._no_such_name < EMPTY_AFTER_NXDOMAIN or not self.endpoints:
                return
            log.warning(
                "pool %s: %s has no address (NXDOMAIN %d times in a row): the pool is empty",
                self.name,
                self.cfg.dns.name,
                self._no_such_name,
            )
            bases = []
        else:
            self._no_such_name = 0
        added = self.set_endpoints(bases)
        if added:
            await self.check_all(added)

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.dns.refresh_seconds)
            with contextlib.suppress(Exception):
                await self.discover_once()

    async def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        await self.discover_once()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._health_loop()))
        if self.cfg.discovery == "dns":
            self._tasks.append(loop.create_task(self._dns_loop()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
