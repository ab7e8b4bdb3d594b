"""Structured (one JSON object per line) logging with the request id.

Exception messages are never written: those of aiohttp's HTTP parser quote the request bytes
(an ``Authorization`` header, a prompt), so a record's ``exc`` is the exception's type and
traceback frames only. Warnings and errors are rate-limited per message template, so a
client cannot turn bad requests into a flood of log lines.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any

import orjson
from aiohttp.http_exceptions import HttpProcessingError

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_MAX_FRAMES = 20  # the innermost ones; a deep recursion must not make a huge line


def _from_aiohttp(record: logging.LogRecord) -> bool:
    return record.name == "aiohttp" or record.name.startswith("aiohttp.")


def exc_summary(
    exc_info: tuple[type[BaseException], BaseException, TracebackType | None],
) -> str:
    """``module.Type at file:line in function > ...`` (outermost frame first, as Python
    prints them), the same for each chained cause; never the exception's message or args."""
    etype, exc, tb = exc_info
    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        t = type(cur) if cur is not exc else etype
        frames = traceback.extract_tb(cur.__traceback__ if cur is not exc else tb)
        shown = [f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-_MAX_FRAMES:]]
        if len(frames) > _MAX_FRAMES:
            shown.insert(0, f"... {len(frames) - _MAX_FRAMES} more")
        name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
        parts.append(name + (" at " + " > ".join(shown) if shown else ""))
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return "; caused by ".join(parts)


def _message(record: logging.LogRecord) -> str:
    if _from_aiohttp(record) and record.args:
        # aiohttp's own records: an exception among the args would print its message
        args = record.args if isinstance(record.args, tuple) else (record.args,)
        if any(isinstance(a, BaseException) for a in args):
            safe = tuple(type(a).__name__ if isinstance(a, BaseException) else a for a in args)
            try:
                return str(record.msg) % safe
            except (TypeError, ValueError):
                return str(record.msg)
    return record.getMessage()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _message(record),
        }
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_"):
                out[k] = v
        if record.exc_info and record.exc_info[0] is not None:
            out["exc"] = exc_summary(record.exc_info)  # type: ignore[arg-type]
        return orjson.dumps(out, default=str).decode()


class ParserErrorFilter(logging.Filter):
    """aiohttp logs every request its parser refuses as "Error handling request from %s" at
    error level with a traceback whose message quotes the request bytes: one short warning
    line naming the exception class (and the status) instead. Errors that are not the
    parser's (a handler failed: a 500) keep their level and frames."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "Error handling request from %s" or not _from_aiohttp(record):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        if isinstance(exc, HttpProcessingError):
            record.msg = "refused a malformed HTTP request from %s: %s (status %s)"
            record.args = (remote, type(exc).__name__, exc.code or 400)
            record.exc_info = None
            record.exc_text = None
            # the client's mistake, not the router's
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class RateLimit(logging.Filter):
    """At most ``limit`` warning-or-worse records per (logger, message template) in each
    ``window`` seconds; the next one let through after a drop carries ``suppressed: N``."""

    _MAX_KEYS = 1024  # templates are code, but some are f-strings: bound the table

    def __init__(
        self, limit: int = 10, window: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.limit = limit
        self.window = window
        self.clock = clock
        self._state: dict[tuple[str, Any], list[Any]] = {}  # key -> [start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        msg = record.msg if isinstance(record.msg, str) else type(record.msg).__name__
        key = (record.name, msg)
        now = self.clock()
        st = self._state.get(key)
        if st is None or now - st[0] >= self.window:
            if st is None and len(self._state) >= self._MAX_KEYS:
                self._prune(now)
            st = self._state[key] = [now, 0, st[2] if st else 0]
        if st[1] >= self.limit:
            st[2] += 1
            return False
        st[1] += 1
        if st[2]:
            record.suppressed = st[2]
            st[2] = 0
        return True

    def _prune(self, now: float) -> None:
        for k in [k for k, st in self._state.items() if now - st[0] >= self.window]:
            del self._state[k]
        while len(self._state) >= self._MAX_KEYS:  # all current: forget the oldest
            del self._state[next(iter(self._state))]


class AccessLog:
    """The one line per request (``"msg": "request"``), in the shape :class:`JsonFormatter`
    writes, without the logging machinery: measured on this project's 2-core box, 45 µs per
    line through ``logging`` (record, filters, formatter, lock, flush) against 4 µs here
    (orjson and one write of whole lines, so lines never interleave mid-way). On only when the
    ``pd_router`` logger is enabled for info; every field is the router's own (the request id
    is validated, the path one of the router's routes), so nothing needs redacting."""

    __slots__ = ("_fd", "_second", "_stamp", "enabled")

    def __init__(self, logger: logging.Logger, stream: Any = None) -> None:
        self.enabled = logger.isEnabledFor(logging.INFO)
        out = stream if stream is not None else sys.stdout
        try:
            self._fd: int | None = out.fileno()
        except (AttributeError, OSError, ValueError):  # no file behind it (a test's capture)
            self._fd = None
        self._second = -1
        self._stamp = ""

    def write(
        self,
        rid: str,
        route: str,
        reason: str,
        status: int,
        path: str,
        duration_ms: float,
        kv_revision: str = "",
        trace_id: str = "",
        engine: str = "",
        prefiller: str = "",
    ) -> None:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        line = {
            "ts": f"{self._stamp}.{int((now - second) * 1000):03d}Z",
            "level": "info",
            "logger": "pd_router",
            "msg": "request",
            "request_id": rid,
            "route": route,
            "reason": reason,
            "status": status,
            "path": path,
            "duration_ms": duration_ms,
            "kv_revision": kv_revision,  # the answering decoder's (pd_router.revision)
            "trace_id": trace_id,  # W3C trace id (pd_router.tracing); "" = no trace context
            "engine": engine,  # the engine that answered (its base URL); "" = none did
            "prefiller": prefiller,  # the engine its prefill leg went to; "" = none
        }
        data = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
        if self._fd is None:
            sys.stdout.write(data.decode())
            return
        try:
            os.write(self._fd, data)
        except OSError:
            pass  # a closed or full stdout must not fail the request


def setup(level: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter())
    # on the handler, so they see every logger's records (a logger's filters see only its own)
    handler.addFilter(ParserErrorFilter())
    handler.addFilter(RateLimit())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
