"""Fetch the model's ``tokenizer.json`` from a Hugging Face-compatible hub once at start-up
(``model.tokenizerHub``). Not ``huggingface_hub`` (not in the router image; ``tokenizers``'
``from_pretrained`` needs it): one bounded async GET on the router's own event loop, with the
timeouts and the outcomes below, is all the router needs.

Hub contract (huggingface_hub's ``HUGGINGFACE_CO_URL_TEMPLATE``, whose endpoint is what
``HF_ENDPOINT`` sets): ``GET {endpoint}/{repo}/resolve/{revision}/tokenizer.json`` with the
revision percent-encoded,
``Authorization: Bearer <token>`` for gated or private repos; files kept in LFS/Xet answer with
a redirect to a CDN, which is followed (aiohttp drops ``Authorization`` when a redirect leaves
the origin, so the token never reaches the CDN).

Outcomes, decided so that a router pod neither crash-loops on a hub outage nor hides a
configuration mistake:

- 401/403/404 or a file that is not a tokenizer: :class:`ConfigError` naming the field; the
  router stops with exit 2 like any other bad config (retrying cannot fix it).
- Connection errors, timeouts, 429 and 5xx: retried with back-off until
  ``timeoutSeconds``; then :class:`HubUnavailable` and the router counts with the engines'
  ``POST /tokenize`` instead (logged, and ``pd_router_tokenizer_loaded{source="hub"}`` is 0).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import quote

import aiohttp

from pd_router.config import ConfigError, TokenizerHub

FILENAME = "tokenizer.json"
MAX_BYTES = 64 * 1024 * 1024  # the largest public tokenizer.json files are ~30 MiB
_FIRST_BACKOFF = 0.5
_MAX_BACKOFF = 8.0


class HubUnavailable(Exception):
    """The hub did not answer usefully within ``timeoutSeconds`` (transient causes only)."""


def tokenizer_url(hub: TokenizerHub) -> str:
    return (
        f"{hub.endpoint.rstrip('/')}/{hub.repo}/resolve/{quote(hub.revision, safe='')}/{FILENAME}"
    )


def read_token(hub: TokenizerHub) -> str | None:
    if not hub.token_file:
        return None
    try:
        token = Path(hub.token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(
            f"model.tokenizerHub.tokenFile: cannot read {hub.token_file}: {exc}"
        ) from None
    if not token:
        raise ConfigError(f"model.tokenizerHub.tokenFile: {hub.token_file} is empty")
    return token


def _refused(hub: TokenizerHub, status: int, url: str) -> ConfigError:
    if status in (401, 403):
        hint = (
            "the token in model.tokenizerHub.tokenFile was refused"
            if hub.token_file
            else "a gated or private model needs model.tokenizerHub.tokenFile"
        )
        return ConfigError(
            f"model.tokenizerHub.tokenFile: the hub answered {status} for {url}; {hint}"
        )
    if status == 404:
        return ConfigError(
            f"model.tokenizerHub.repo: no {FILENAME} in {hub.repo!r} at revision "
            f"{hub.revision!r} (404 from {url})"
        )
    return ConfigError(f"model.tokenizerHub: the hub answered {status} for {url}")


async def _get_once(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], timeout: float
) -> tuple[int, bytes]:
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with session.get(url, headers=headers, timeout=client_timeout) as resp:
        if resp.status != 200:
            return resp.status, b""
        if (resp.content_length or 0) > MAX_BYTES:
            raise ConfigError(f"model.tokenizerHub: {url} is larger than {MAX_BYTES} bytes")
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(1 << 20):
            size += len(chunk)
            if size > MAX_BYTES:
                raise ConfigError(f"model.tokenizerHub: {url} is larger than {MAX_BYTES} bytes")
            chunks.append(chunk)
        return 200, b"".join(chunks)


async def fetch_tokenizer_json(hub: TokenizerHub) -> str:
    """Return the text of ``tokenizer.json``; raise ConfigError or HubUnavailable."""
    url = tokenizer_url(hub)
    token = read_token(hub)
    headers = {"User-Agent": "pd-router"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    deadline = time.monotonic() + hub.timeout_seconds
    backoff = _FIRST_BACKOFF
    last = "no attempt made"
    # trust_env: HTTPS_PROXY / NO_PROXY / SSL_CERT_FILE, as huggingface_hub (the engines) uses
    async with aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(), trust_env=True
    ) as session:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HubUnavailable(f"{url}: {last} (gave up after {hub.timeout_seconds:g} s)")
            try:
                status, body = await _get_once(session, url, headers, remaining)
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if status == 200:
                    try:
                        return body.decode("utf-8")
                    except UnicodeDecodeError:
                        raise ConfigError(f"model.tokenizerHub: {url} is not UTF-8 text") from None
                if status != 429 and status < 500:
                    raise _refused(hub, status, url)
                last = f"the hub answered {status}"
            # back off, but never past the deadline
            await asyncio.sleep(max(0.0, min(backoff, deadline - time.monotonic())))
            backoff = min(backoff * 2, _MAX_BACKOFF)
