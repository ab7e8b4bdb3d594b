"""Property-based: malformed and hostile requests (bodies, JSON nesting and sizes, wrong
types, smuggled hand-off fields, abused headers and framing) never produce a 500, never hang,
never get a client's hand-off fields to an engine, and leave the routers healthy."""

from __future__ import annotations

import json
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_router.handoff.nixl import PREFILL_PARAMS
from pd_router.openai_wire import MAX_JSON_DEPTH
from pd_router_dev.devstack import Proc, Stack
from router_testlib import LMCacheStack, deep_merge, http_call, long_text, write_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LIMIT = 100_000  # limits.maxBodyBytes of both routers
BODY_WAIT_S = 1  # timeouts.clientBodySeconds of both routers: a stalled body is answered 408
ORJSON_MAX_DEPTH = 1024  # deeper than this, orjson itself refuses to parse
ERROR_KEYS = {"message", "type", "param", "code"}
# the X-Request-Id values the router keeps (app._RID_RE, matched here as a whole)
RID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
RID_BYTES = re.compile(rb"[A-Za-z0-9._:@/+=-]{1,128}")
GENERATED_RID = re.compile(r"[0-9a-f]{32}")  # the router's own (uuid4().hex)
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "model",
        "stream",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "temperature",
        "top_p",
        "stream_options",
        "kv_transfer_params",
        "vllm_xargs",
        "logprobs",
        "tools",
        "ignore_eos",
        "seed",
        "prompt",
        "messages",
        "echo",
        "response_format",
    ]
)
messages = st.one_of(
    json_values,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), json_values)},
            optional={"content": st.one_of(st.text(max_size=200), json_values)},
        ),
        max_size=3,
    ),
)
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.builds(
        lambda base, extra: json.dumps({**base, **extra}).encode(),
        st.fixed_dictionaries(
            {"messages": messages},
            optional={"prompt": st.one_of(st.text(max_size=300), json_values)},
        ),
        st.dictionaries(fields, json_values, max_size=4),
    ),
    st.builds(  # valid-looking long prompts that cross the threshold with odd options
        lambda words, extra: json.dumps(
            {
                "messages": [{"role": "user", "content": " ".join(["w"] * words)}],
                "max_tokens": 3,
                **extra,
            }
        ).encode(),
        st.integers(1, 400),
        st.dictionaries(fields.filter(lambda f: f not in ("messages",)), json_values, max_size=2),
    ),
)


# header values as raw bytes, not necessarily UTF-8: whatever RFC 9110 allows in a field value
# (VCHAR, obs-text, space, tab); control characters are refused by the HTTP parser itself
header_values = st.binary(max_size=60).filter(
    lambda v: all((b >= 32 and b != 127) or b == 9 for b in v)
)
hostile_headers = st.dictionaries(
    st.sampled_from(["X-Request-Id", "x-session-id", "Authorization", "Content-Encoding"]),
    header_values,
    max_size=3,
)


@dataclass
class Setup:
    routers: list[Proc]  # [LMCache router, NIXL router]
    engines: list[str]  # base URLs of every simulated engine behind them
    lmcache_decoder_hosts: tuple[str, ...]


@pytest.fixture(scope="module")
def setup(stack: Stack) -> Iterator[Setup]:
    with pytest.MonkeyPatch.context() as mp:
        # The simulated engines serve n > 1 like vLLM, up to VLLM_MAX_N_SEQUENCES (vLLM's own
        # knob, 16384 by default): a drawn n of thousands with ignore_eos would take minutes.
        mp.setenv("VLLM_MAX_N_SEQUENCES", "16")
        yield _setup(stack)


@pytest.fixture(scope="module")
def routers(setup: Setup) -> list[Proc]:
    return setup.routers


def _setup(stack: Stack) -> Setup:
    common = {"limits": {"maxBodyBytes": LIMIT}, "timeouts": {"clientBodySeconds": BODY_WAIT_S}}
    lm = LMCacheStack(stack)
    lm_router = lm.router(
        "hb-lm", deep_merge({"routing": {"connector": "lmcache", "threshold": 64}}, common)
    )
    pre = stack.sim("hb-nx-prefill", "--kv-connector", "nixl")
    dec = stack.sim("hb-nx-decode", "--kv-connector", "nixl")
    cfg = {
        "routing": {
            "connector": "nixl",
            "threshold": 64,
            "decision": "length",
        },  # the hand-off under test, not the decision (test_router_decision.py)
        "pools": {
            "prefill": {"discovery": "static", "static": [pre.url()]},
            "decode": {"discovery": "static", "static": [dec.url()]},
        },
    }
    nx_router = stack.router("hb-nx", write_config(stack.workdir, "hb-nx", deep_merge(cfg, common)))
    engines = [lm.prefill.url(), *lm.decoder_urls(), pre.url(), dec.url()]
    return Setup([lm_router, nx_router], engines, ("127.0.0.2", "127.0.0.3"))


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    body=bodies,
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
    which=st.integers(0, 1),
    headers=hostile_headers,
)
def test_hostile_bodies(
    routers: list[Proc], body: bytes, path: str, which: int, headers: dict[str, bytes]
) -> None:
    post(routers[which], path, body, dict(headers))


def _nested(levels: int) -> str:
    """JSON text nesting ``levels`` containers, objects and lists alternating (built as text:
    the json module recurses and stops near 1000 levels)."""
    opens = "".join('{"k":' if i % 2 == 0 else "[" for i in range(levels))
    closes = "".join("}" if i % 2 == 0 else "]" for i in reversed(range(levels)))
    return opens + '"x"' + closes


def _deep_body(chat: bool, where: str, depth: int) -> bytes:
    """A request whose JSON nests ``depth`` levels in all (the body object is level 1)."""
    if not chat:
        return ('{"prompt": "hi", "max_tokens": 2, "tools": ' + _nested(depth - 1) + "}").encode()
    if where == "message":  # body > messages > message > extra
        msg = '{"role": "user", "content": "hi", "extra": ' + _nested(depth - 3) + "}"
        return ('{"messages": [' + msg + '], "max_tokens": 2}').encode()
    msg = '{"role": "user", "content": "hi"}'
    tools = _nested(depth - 1)
    return ('{"messages": [' + msg + '], "max_tokens": 2, "tools": ' + tools + "}").encode()


@pytest.mark.parametrize("depth", [200, 254, 255, 600, 1024])
@pytest.mark.parametrize(
    ("path", "where"),
    [
        ("/v1/chat/completions", "message"),
        ("/v1/chat/completions", "tools"),
        ("/v1/completions", "tools"),
    ],
)
def test_deeply_nested_json_is_400_naming_the_limit(
    routers: list[Proc], path: str, where: str, depth: int
) -> None:
    """orjson parses 1024 levels but writes only 254; the router re-serializes bodies, so
    255-1024 levels used to end in a 500."""
    body = _deep_body(path.endswith("chat/completions"), where, depth)
    for router in routers:
        hdrs = {"Content-Type": "application/json"}
        status, _, data = http_call(router.url() + path, "POST", body, hdrs, timeout=30)
        assert status == 400, (router.name, status, data[:300])
        err = json.loads(data)["error"]
        assert err["type"] == "invalid_request_error"
        assert "128 levels" in err["message"], err


def test_many_brackets_but_shallow_json_is_served(routers: list[Proc]) -> None:
    """The depth walk runs only when brackets outnumber the limit; a wide, shallow body (many
    small objects) passes it."""
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(300)]
    for router in routers:
        for path, body in (
            ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "vllm_xargs": {"a": msgs}}),
        ):
            hdrs = {"Content-Type": "application/json"}
            raw = json.dumps(body).encode()
            status, _, data = http_call(router.url() + path, "POST", raw, hdrs, timeout=30)
            assert status == 200, (router.name, path, status, data[:300])


# ---------------------------------------------------------------------- shared checks


def check_answer(status: int, hdrs: dict[str, str], data: bytes, what: Any = "") -> None:
    """What every answer to a well-formed HTTP request must be: no 5xx (the engines here are
    healthy, so not even a 502-504), an X-Request-Id the router accepts, and every error (a
    whole answer or an SSE event) as JSON in OpenAI's shape."""
    assert status < 500, (status, what, data[:300])
    assert RID.fullmatch(hdrs.get("x-request-id", "")), (hdrs, what)
    ctype = hdrs.get("content-type", "")
    if status >= 400:
        assert ctype.startswith("application/json"), (status, ctype, what, data[:300])
        err = json.loads(data)["error"]
        assert set(err) == ERROR_KEYS, (err, what)
        assert isinstance(err["message"], str) and isinstance(err["type"], str), err
    elif ctype.startswith("text/event-stream"):
        for line in data.split(b"\n"):
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    assert set(event["error"]) == ERROR_KEYS, (event, what)


def post(
    router: Proc, path: str, raw: bytes, headers: dict[str, Any] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """POST ``raw`` as is (a 30 s client timeout: nothing may hang) and check the answer."""
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    status, got, data = http_call(router.url() + path, "POST", raw, hdrs, timeout=30)
    check_answer(status, got, data, raw[:200])
    return status, got, data


def error_of(data: bytes) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(data)["error"]
    return err


def json_depth(text: bytes) -> int:
    """Deepest container nesting of a JSON text (brackets inside strings do not count)."""
    depth = deepest = 0
    in_str = esc = False
    for b in text:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif b in b"]}":
            depth -= 1
    return deepest


# ---------------------------------------------------------------------- 1. nesting depth

# where a nested value V goes; the body object is level 1
DEEP_PLACES: dict[str, tuple[str, str]] = {
    "content": (CHAT, '{"messages": [{"role": "user", "content": V}], "max_tokens": 2}'),
    "content_part": (
        CHAT,
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": V}]}]}',
    ),
    "message_field": (CHAT, '{"messages": [{"role": "user", "content": "hi", "name": V}]}'),
    "tools": (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "tools": V}'),
    "tool_choice": (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "tool_choice": V}'),
    "response_format": (
        CHAT,
        '{"messages": [{"role": "user", "content": "hi"}], "response_format": V}',
    ),
    "stream_options": (
        CHAT,
        '{"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": V}',
    ),
    "kv_transfer_params": (
        CHAT,
        '{"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": V}',
    ),
    "logit_bias": (COMPLETIONS, '{"prompt": "hi", "max_tokens": 2, "logit_bias": V}'),
    "prompt": (COMPLETIONS, '{"prompt": V, "max_tokens": 2}'),
    "vllm_xargs": (COMPLETIONS, '{"prompt": "hi", "max_tokens": 2, "vllm_xargs": V}'),
    "unknown_field": (COMPLETIONS, '{"prompt": "hi", "max_tokens": 2, "x_unknown": V}'),
    "under_unknown": (COMPLETIONS, '{"prompt": "hi", "metadata": {"a": [{"b": V}]}}'),
}
DEEP_LEAVES = ['"x"', "1", "-0.5", "null", "true", '""', '"\\u0000"', '"[[[[{{{{"', "1e308"]
# levels near the limits: the router's (128), orjson's writer (254) and reader (1024)
DEEP_EDGES = [0, 1, 2, 120, 123, 125, 126, 127, 128, 129, 252, 253, 254, 255, 1020, 1023, 1024]


@st.composite
def deep_values(draw: st.DrawFn) -> str:
    """A JSON value nesting 0..1100 containers (built as text by a loop: st.recursive nests a
    few levels only, and the json module stops near 1000), each level an object or a list
    after a drawn pattern, with optional siblings at every level."""
    depth = draw(st.sampled_from(DEEP_EDGES) | st.integers(0, 1100))
    pattern = draw(st.sampled_from(["o", "l", "ol", "lo", "oll", "loo"]))
    key = draw(st.sampled_from(['"k"', '""', '"kv_transfer_params"', '"\\u00e9"', '"a b"']))
    leaf = draw(st.sampled_from(DEEP_LEAVES))
    sibling = draw(st.sampled_from(["", '"s", ', "0, ", '{"a": [1]}, ']))
    opens, closes = [], []
    for i in range(depth):
        if pattern[i % len(pattern)] == "o":
            opens.append("{" + (f'"s{i}": 0, ' if sibling else "") + key + ": ")
            closes.append("}")
        else:
            opens.append("[" + sibling)
            closes.append("]")
    return "".join(opens) + leaf + "".join(reversed(closes))


@settings(SETTINGS, max_examples=100)  # cheap: small bodies
@given(
    place=st.sampled_from(sorted(DEEP_PLACES)),
    value=deep_values(),
    unbalanced=st.integers(0, 3),
    which=st.integers(0, 1),
)
def test_nesting_at_any_depth_anywhere(
    routers: list[Proc], place: str, value: str, unbalanced: int, which: int
) -> None:
    """Deeper than the router's limit: 400 naming it (orjson's own limit, 1024 levels: 400
    malformed JSON); within it, whatever the engine answers, never a 500. Truncated texts
    (closing brackets cut off) are malformed JSON, whatever their depth."""
    path, template = DEEP_PLACES[place]
    text = template.replace("V", value)
    if unbalanced:
        text = text[: -unbalanced * 2]
    raw = text.encode()
    depth = json_depth(raw)
    status, _, data = post(routers[which], path, raw)
    if unbalanced or depth > ORJSON_MAX_DEPTH:
        assert status == 400 and "malformed JSON" in error_of(data)["message"], data[:300]
    elif depth > MAX_JSON_DEPTH:
        assert status == 400, data[:300]
        err = error_of(data)
        assert err["type"] == "invalid_request_error"
        assert f"{MAX_JSON_DEPTH} levels" in err["message"], err


# ---------------------------------------------------------------------- 2. sizes

UNITS = [
    "a",
    "w ",
    "\u00e9",
    "\U0001f600",
    "\u0000",
    "\u2028",
    "\ufeff",
    "\uffff",
    "\U0010ffff",
    "\\",
    '"',
    "\t\n",
    "\u200f\u0301",
    "</script>",
]
BUDGET = 80_000  # bytes a sized field may take: the whole body stays well under LIMIT


def sizes(top: int) -> st.SearchStrategy[int]:
    """1..top, drawn from the large end half of the time."""
    return st.integers(1, top) | st.integers(top // 2, top) | st.just(top)


@st.composite
def big_strings(draw: st.DrawFn, budget: int = BUDGET) -> str:
    unit = draw(st.sampled_from(UNITS))
    size = draw(sizes(budget))
    return unit * max(1, size // len(json.dumps(unit)))


def _sized_bodies() -> st.SearchStrategy[tuple[str, Any]]:
    """(path, body) with one very long string, list or object somewhere."""
    msg = lambda c: {"messages": [{"role": "user", "content": c}], "max_tokens": 2}  # noqa: E731
    return st.one_of(
        st.builds(lambda s: (CHAT, msg(s)), big_strings()),
        st.builds(lambda s: (COMPLETIONS, {"prompt": s, "max_tokens": 2}), big_strings()),
        st.builds(
            lambda s, k: (CHAT, {**msg("hi"), k: s}),
            big_strings(),
            st.sampled_from(["model", "user", "stop", "x_unknown", "tool_choice", "chat_template"]),
        ),
        st.builds(  # a long token-id prompt (the LMCache prefill leg's own prompt form)
            lambda n, k: (COMPLETIONS, {"prompt": [i * k % 50_000 for i in range(n)]}),
            sizes(12_000),
            st.integers(1, 10**6),
        ),
        st.builds(lambda n: (COMPLETIONS, {"prompt": ["w"] * n, "max_tokens": 1}), sizes(1100)),
        st.builds(
            lambda n: (CHAT, {"messages": [{"role": "user", "content": "m"}] * n}),
            sizes(2400),
        ),
        st.builds(lambda n: (CHAT, {**msg("hi"), "stop": ["s"] * n}), sizes(15_000)),
        st.builds(
            lambda n: (COMPLETIONS, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(n)}}),
            sizes(7000),
        ),
        st.builds(
            lambda n: (CHAT, {**msg("hi"), "tools": [{"type": "function"}] * n}),
            sizes(3000),
        ),
        st.builds(
            lambda n: (COMPLETIONS, {"prompt": "hi", "vllm_xargs": {"a": [0] * n}}),
            sizes(25_000),
        ),
    )


# numbers as JSON text: beyond 64 bits, beyond a double, denormal, negative zero
NUMBER_LITERALS = [
    "0",
    "-0",
    "-1",
    "1.0",
    "1e2",
    "1E+2",
    "0.1e1",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "1" + "0" * 400,
    "-" + "9" * 5000,
    "1e308",
    "1e309",
    "-1e400",
    "5e-324",
    "1e-400",
    "0." + "0" * 3000 + "1",
]
UNPARSABLE_NUMBERS = {"1" + "0" * 400, "-" + "9" * 5000, "1e309", "-1e400"}  # infinite
NUMBER_FIELDS = [
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "seed",
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "logprobs",
    "top_logprobs",
    "x_unknown",
]


@SETTINGS
@given(sized=_sized_bodies(), which=st.integers(0, 1), ascii_only=st.booleans())
def test_long_strings_and_lists_under_the_limit(
    routers: list[Proc], sized: tuple[str, Any], which: int, ascii_only: bool
) -> None:
    path, body = sized
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    assert len(raw) < LIMIT - 5000
    status, _, data = post(routers[which], path, raw)
    assert status != 413, data[:300]


@SETTINGS
@given(
    field=st.sampled_from(NUMBER_FIELDS),
    literal=st.sampled_from(NUMBER_LITERALS),
    where=st.sampled_from(["top", "prompt_ids", "logit_bias", "stream_options"]),
    chat=st.booleans(),
    which=st.integers(0, 1),
)
def test_huge_and_odd_numbers(
    routers: list[Proc], field: str, literal: str, where: str, chat: bool, which: int
) -> None:
    """Numbers orjson reads as floats (beyond 64 bits) or cannot read (beyond a double: 400
    malformed JSON), anywhere in a body."""
    base = '"messages": [{"role": "user", "content": "hi"}]' if chat else '"prompt": "hi"'
    if where == "top":
        text = f"{{{base}, {json.dumps(field)}: {literal}}}"
    elif where == "prompt_ids":
        chat = False
        text = f'{{"prompt": [1, {literal}, 2], "max_tokens": 2}}'
    elif where == "logit_bias":
        text = f'{{{base}, "logit_bias": {{"1": {literal}}}}}'
    else:
        text = f'{{{base}, "stream": true, "stream_options": {{"include_usage": {literal}}}}}'
    status, _, data = post(routers[which], CHAT if chat else COMPLETIONS, text.encode())
    if literal in UNPARSABLE_NUMBERS:
        assert status == 400 and "malformed JSON" in error_of(data)["message"], data[:300]


# raw byte sequences that are not UTF-8 (or not allowed in a JSON string)
BAD_BYTES = [
    b"\xed\xa0\x80",  # a lone high surrogate, UTF-8 encoded (CESU)
    b"\xed\xbf\xbf",  # a lone low surrogate
    b"\xed\xa0\xbd\xed\xb8\x80",  # a surrogate pair encoded as two code points
    b"\xff",
    b"\xc0\xaf",  # overlong '/'
    b"\xe0\x80\xaf",
    b"\xf4\x90\x80\x80",  # above U+10FFFF
    b"\xf8\x88\x80\x80\x80",
    b"\xc3",  # truncated sequence
    b"\x00",  # a raw NUL inside a string
    b"\x1f",
    b"\n",
]
# escapes that are valid JSON for Python's json module but not lone-surrogate-free
BAD_ESCAPES = [b"\\ud800", b"\\udfff", b"\\udc00\\ud800", b"\\ud83d", b"x\\ud800y"]
GOOD_ESCAPES = [b"\\u0000", b"\\ud83d\\ude00", b"\\uffff", b"\\u2028", b"\\ufeff", b"\\/"]


@SETTINGS
@given(
    where=st.sampled_from(["content", "model", "key", "stop", "user", "prompt"]),
    piece=st.sampled_from(BAD_BYTES + BAD_ESCAPES + GOOD_ESCAPES),
    repeat=st.sampled_from([1, 2, 1000]),
    which=st.integers(0, 1),
)
def test_unicode_edge_cases(
    routers: list[Proc], where: str, piece: bytes, repeat: int, which: int
) -> None:
    """Invalid UTF-8 and lone surrogates (raw bytes or \\u escapes) are malformed JSON to
    orjson: 400; valid edge cases (escaped NUL, U+FFFF, U+2028, BOM...) are served."""
    s = b'"a' + piece * repeat + b'z"'
    path = COMPLETIONS if where == "prompt" else CHAT
    base = b'"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
    raw = {
        "content": b'{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}' % s,
        "model": b'{%s, "model": %s}' % (base, s),
        "key": b"{%s, %s: 1}" % (base, s),
        "stop": b'{%s, "stop": [%s]}' % (base, s),
        "user": b'{%s, "user": %s}' % (base, s),
        "prompt": b'{"prompt": %s, "max_tokens": 2}' % s,
    }[where]
    status, _, data = post(routers[which], path, raw)
    if piece in GOOD_ESCAPES:
        # a model name other than the served one is 404; all else is served
        assert status == (404 if where == "model" else 200), data[:300]
    else:
        assert status == 400 and "malformed JSON" in error_of(data)["message"], data[:300]


def test_unicode_framing_of_the_whole_body(routers: list[Proc]) -> None:
    """A BOM, UTF-16 or UTF-32 body: not UTF-8 JSON, 400 (the router never guesses)."""
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    for raw in (
        b"\xef\xbb\xbf" + body.encode(),
        body.encode("utf-16"),
        body.encode("utf-16-le"),
        body.encode("utf-32"),
        b"\x00" + body.encode(),
        body.encode() + b"\x00",
    ):
        for router in routers:
            status, _, data = post(router, CHAT, raw)
            assert status == 400, (raw[:20], data[:300])


def _padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` as JSON padded with trailing spaces to exactly ``size`` bytes (valid JSON)."""
    raw = json.dumps(body).encode()
    assert len(raw) <= size
    return raw + b" " * (size - len(raw))


@pytest.mark.parametrize("over", [0, 1, 2, 1000, LIMIT])
def test_bodies_at_and_over_max_body_bytes(routers: list[Proc], over: int) -> None:
    """limits.maxBodyBytes exactly is served; a byte more is 413 (with a Content-Length it is
    refused before the body is read; chunked, once it grows past the limit)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    raw = _padded(body, LIMIT + over)
    for router in routers:
        status, _, data = post(router, CHAT, raw)
        assert status == (200 if over == 0 else 413), data[:300]
        got = parse_raw(raw_exchange(router.port, chunked_request(CHAT, raw)))
        assert got.status == (200 if over == 0 else 413), got
        check_raw(got)


# ---------------------------------------------------------------------- 3. wrong types

# every top-level field the router itself reads, and the ones it hands on to the engines
KNOWN_FIELDS = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "ignore_eos",
    "tools",
    "functions",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "stop",
    "stop_token_ids",
    "seed",
    "user",
    "logit_bias",
    "suffix",
    "best_of",
    "kv_transfer_params",
    "vllm_xargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "documents",
    "request_id",
    "priority",
    "include_stop_str_in_output",
]
# one value of every JSON type, a few of each (edge values included)
TYPE_SAMPLES: dict[str, list[Any]] = {
    "null": [None],
    "bool": [True, False],
    "int": [0, -1, 2, 2**63],
    "float": [0.5, -1e300, 1.0],
    "string": ["", "x", "1", "true"],
    "list": [[], [1], ["a"], [{}]],
    "object": [{}, {"a": 1}, {"type": "text"}],
}
any_type = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.lists(st.none() | st.integers() | st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=6), st.none() | st.integers() | st.text(max_size=4)),
)


def _base(chat: bool, long: bool, stream: bool = False) -> dict[str, Any]:
    """A valid request: short (served directly) or long (split by both routers)."""
    text = long_text(200) if long else "hi"
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    )
    body["max_tokens"] = 3
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


@pytest.mark.parametrize("field", KNOWN_FIELDS)
def test_every_known_field_with_every_json_type(routers: list[Proc], field: str) -> None:
    """Each field in turn holds each JSON type (on a short and a long prompt, both endpoints,
    both routers): validated or handed on, never a 500."""
    for i, values in enumerate(TYPE_SAMPLES.values()):
        for j, value in enumerate(values):
            for chat in (True, False):
                body = {**_base(chat, long=(i + j + chat) % 2 == 1), field: value}
                raw = json.dumps(body).encode()
                for router in routers:
                    post(router, CHAT if chat else COMPLETIONS, raw)


# fields inside fields, with a wrong type each
NESTED_WRONG: dict[str, Callable[[Any], dict[str, Any]]] = {
    "role": lambda v: {"messages": [{"role": v, "content": "hi"}]},
    "content": lambda v: {"messages": [{"role": "user", "content": v}]},
    "part_type": lambda v: {"messages": [{"role": "user", "content": [{"type": v, "text": "x"}]}]},
    "part_text": lambda v: {
        "messages": [{"role": "user", "content": [{"type": "text", "text": v}]}]
    },
    "message": lambda v: {"messages": [v]},
    "messages_2nd": lambda v: {"messages": [{"role": "user", "content": "hi"}, v]},
    "include_usage": lambda v: {"stream": True, "stream_options": {"include_usage": v}},
    "continuous_usage": lambda v: {"stream": True, "stream_options": {"continuous_usage_stats": v}},
    "tool": lambda v: {"tools": [v]},
    "tool_function": lambda v: {"tools": [{"type": "function", "function": v}]},
    "tool_choice_fn": lambda v: {"tool_choice": {"type": "function", "function": v}},
    "response_format_type": lambda v: {"response_format": {"type": v}},
    "json_schema": lambda v: {"response_format": {"type": "json_schema", "json_schema": v}},
    "logit_bias_value": lambda v: {"logit_bias": {"1": v}},
    "prompt_item": lambda v: {"prompt": [v]},
    "prompt_ids_item": lambda v: {"prompt": [1, v]},
    "prompt_nested_item": lambda v: {"prompt": [[1, v]]},
    "stop_item": lambda v: {"stop": ["a", v]},
    "xargs_value": lambda v: {"vllm_xargs": {"a": v}},
    "template_kwargs": lambda v: {"chat_template_kwargs": {"enable_thinking": v}},
}


@SETTINGS
@given(
    top=st.dictionaries(st.sampled_from(KNOWN_FIELDS), any_type, min_size=1, max_size=4),
    nested=st.lists(st.tuples(st.sampled_from(sorted(NESTED_WRONG)), any_type), max_size=2),
    chat=st.booleans(),
    long=st.booleans(),
    stream=st.booleans(),
    which=st.integers(0, 1),
)
def test_wrong_types_together(
    routers: list[Proc],
    top: dict[str, Any],
    nested: list[tuple[str, Any]],
    chat: bool,
    long: bool,
    stream: bool,
    which: int,
) -> None:
    body = _base(chat, long, stream)
    for name, value in nested:
        body.update(NESTED_WRONG[name](value))
    body.update(top)
    post(routers[which], CHAT if chat else COMPLETIONS, json.dumps(body).encode())


# ---------------------------------------------------------------------- 4. smuggled hand-off

MARK = "EVIL"  # in every smuggled value; STRIP marks what the router must remove
HANDOFF_KEYS = [
    "kv_transfer_params",
    "disagg_spec",
    "lmcache",
    "ret_first_tok",
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_host",
    "remote_request_id",
    "request_id",
    "req_id",
    "x_request_id",
    "X-Request-Id",
]
CASINGS: list[Callable[[str], str]] = [
    str.upper,
    str.title,
    lambda k: k[0].upper() + k[1:],
    lambda k: k.replace("_", "-"),
    lambda k: re.sub(r"_(.)", lambda m: m.group(1).upper(), k),  # camelCase
    lambda k: k + " ",
    lambda k: "_" + k,
]


def _evil(mark: str) -> dict[str, Any]:
    """Hand-off parameters a client could forge (LMCache's and NIXL's), all marked."""
    return {
        "disagg_spec": {
            "req_id": mark,
            "receiver_host": "10.6.6.6",
            "receiver_init_port": [1],
            "receiver_alloc_port": [2],
        },
        "ret_first_tok": True,
        "do_remote_prefill": True,
        "do_remote_decode": True,
        "remote_engine_id": mark,
        "remote_block_ids": [1, 2],
        "remote_host": "10.6.6.6",
        "remote_port": 1,
        "remote_request_id": mark,
        "lmcache": {"req_id": mark},
    }


@st.composite
def smuggles(draw: st.DrawFn, chat: bool) -> tuple[list[str], list[tuple[str, Any]]]:
    """(raw JSON members put in front of the body's own, (key, value) placements)."""
    n = draw(st.integers(0, 10**6))
    strip = f"{MARK}STRIP{n}"  # what strip_handoff_fields removes
    passed = f"{MARK}PASS{n}"  # unread by vLLM: may pass
    evil_s = json.dumps(_evil(strip))
    raw_members = draw(
        st.lists(
            st.sampled_from(
                [
                    f'"kv_transfer_params": {evil_s}',  # then the body's own (last wins)
                    f'"kv_transfer_param\\u0073": {evil_s}',  # the same key, escaped
                    f'"\\u006bv_transfer_params": {evil_s}',
                    f'"vllm_xargs": {{"kv_transfer_params": {evil_s}}}',
                    f'"vllm_xargs": {{"kv\\u005ftransfer_params": {evil_s}, "k": 1}}',
                    f'"vllm_xargs": {{"kv_transfer_params": {evil_s}, "kv_transfer_params": 1}}',
                    f'"kv_transfer_params": {evil_s}, "kv_transfer_params": {{}}',
                ]
            ),
            max_size=2,
        )
    )
    where = [
        ("top", "kv_transfer_params", strip),
        ("xargs", "kv_transfer_params", strip),
        ("top_cased", "kv_transfer_params", passed),
        ("top", "other", passed),
        ("nested", "any", passed),
    ]
    if chat:
        where += [("message", "any", passed), ("part", "any", passed)]
    picks = draw(st.lists(st.sampled_from(where), min_size=0 if raw_members else 1, max_size=4))
    placements: list[tuple[str, Any]] = []
    for place, key, mark in picks:
        value: Any = draw(st.sampled_from([_evil(mark), mark, [_evil(mark)]]))
        if key == "other":
            key = draw(st.sampled_from(HANDOFF_KEYS[1:]))
        elif key == "any":
            key = draw(st.sampled_from(HANDOFF_KEYS))
        if key == "request_id":
            value = mark  # a string, as vLLM takes it (and the simulator validates)
        if place == "top_cased":
            key = draw(st.sampled_from(CASINGS))(key)
            place = "top"
        if place in ("top", "xargs") and key == "kv_transfer_params":
            value = _evil(mark)  # a dict, as vLLM takes it (and the simulator validates)
        placements.append((f"{place}:{key}", value))
    return raw_members, placements


def _apply(body: dict[str, Any], placements: list[tuple[str, Any]]) -> None:
    for spot, value in placements:
        place, key = spot.split(":", 1)
        if place == "top":
            body[key] = value
        elif place == "xargs":
            body["vllm_xargs"] = {key: value, "keep_me": 1}
        elif place == "nested":
            body["metadata"] = {"a": {key: value}, "b": [{key: value}]}
            body["chat_template_kwargs"] = {key: value}
        elif place == "message":
            body["messages"][0][key] = value
        elif place == "part":
            msg = body["messages"][0]
            if isinstance(msg["content"], str):
                msg["content"] = [{"type": "text", "text": msg["content"]}]
            msg["content"][0][key] = value


def engine_log(setup: Setup, clear: bool = False) -> list[dict[str, Any]]:
    """Every request the simulated engines parsed since the last clear."""
    seen: list[dict[str, Any]] = []
    for base in setup.engines:
        status, _, data = http_call(base + "/sim/requests" + ("?clear=1" if clear else ""))
        assert status == 200
        seen += json.loads(data)
    return seen


def assert_no_client_handoff(setup: Setup, seen: list[dict[str, Any]], rid: str) -> None:
    """What reached the engines carries the router's hand-off fields only: top-level
    ``kv_transfer_params`` are the router's own (LMCache: its disagg_spec naming a decoder
    and this request; NIXL: the prefill flags, or what the prefiller returned), nothing in
    ``vllm_xargs``, nothing of what strip_handoff_fields removes anywhere, and the
    router's X-Request-Id."""
    for rec in seen:
        body = rec["body"]
        assert rec["x_request_id"] == rid, rec
        assert f"{MARK}STRIP" not in json.dumps(body), rec
        xargs = body.get("vllm_xargs")
        assert not (isinstance(xargs, dict) and "kv_transfer_params" in xargs), rec
        kv = body.get("kv_transfer_params")
        if kv is None:
            continue
        assert MARK not in json.dumps(kv), rec
        if "disagg_spec" in kv:  # LMCache prefill leg
            assert kv["ret_first_tok"] is True and rec["path"] == COMPLETIONS, rec
            assert kv["disagg_spec"]["req_id"].startswith(rid + "-"), rec
            assert kv["disagg_spec"]["receiver_host"] in setup.lmcache_decoder_hosts, rec
        elif kv.get("do_remote_decode"):  # NIXL prefill leg
            assert kv == PREFILL_PARAMS, rec
        else:  # NIXL decode leg: the prefiller's answer
            assert kv["do_remote_prefill"] is True and kv["remote_host"] == "127.0.0.1", rec


@SETTINGS
@given(
    data=st.data(),
    chat=st.booleans(),
    long=st.booleans(),
    stream=st.booleans(),
    which=st.integers(0, 1),
    send_rid=st.booleans(),
)
def test_smuggled_handoff_fields_never_reach_an_engine(
    setup: Setup,
    data: st.DataObject,
    chat: bool,
    long: bool,
    stream: bool,
    which: int,
    send_rid: bool,
) -> None:
    """Forged hand-off fields at the top level (exact, escaped, duplicated, other casings),
    in ``vllm_xargs``, in messages, content parts and nested objects, with forged request
    ids: the request is served, and no engine gets a client's ``kv_transfer_params``."""
    raw_members, placements = data.draw(smuggles(chat))
    body = _base(chat, long, stream)
    _apply(body, placements)
    text = json.dumps(body)
    if raw_members:  # duplicate keys: orjson, like Python's json, keeps the last one
        text = "{" + ", ".join(raw_members) + ", " + text[1:]
    rid = f"hb-{uuid.uuid4().hex}"
    headers = {"X-Request-Id": rid} if send_rid else {}
    engine_log(setup, clear=True)
    status, hdrs, answer = post(
        setup.routers[which], CHAT if chat else COMPLETIONS, text.encode(), headers
    )
    assert status == 200, answer[:300]
    got_rid = hdrs["x-request-id"]
    assert got_rid == rid if send_rid else GENERATED_RID.fullmatch(got_rid)
    assert MARK not in json.dumps(dict(hdrs))
    assert hdrs["x-pd-route"] == ("disaggregated" if long else "direct")
    if not stream:
        assert MARK not in json.loads(answer)["id"]
    seen = engine_log(setup)
    assert len(seen) == (2 if long else 1), seen  # prefill and decode legs, or one direct
    assert_no_client_handoff(setup, seen, got_rid)
    if any(spot.startswith("xargs:") for spot, _ in placements):
        # the rest of vllm_xargs is the client's to send: it passes on every leg
        assert all(rec["body"]["vllm_xargs"] == {"keep_me": 1} for rec in seen), seen


# ---------------------------------------------------------------------- 5. headers, framing


@dataclass
class RawAnswer:
    status: int
    headers: list[tuple[str, bytes]]  # (lower-case name, value) as sent
    body: bytes

    def get(self, name: str) -> list[bytes]:
        return [v for k, v in self.headers if k == name]


def raw_exchange(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Send ``data`` as is on a new connection; return the router's bytes up to the end of
    its (final, Content-Length framed) answer, or up to its close. A 30 s socket timeout
    fails the test: nothing may hang."""
    buf = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it took everything: its answer may still be there
        while not _complete(buf):
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def _split_interim(buf: bytes) -> bytes:
    while buf.startswith(b"HTTP/1.1 100 ") and b"\r\n\r\n" in buf:
        buf = buf.split(b"\r\n\r\n", 1)[1]
    return buf


def _complete(buf: bytes) -> bool:
    buf = _split_interim(buf)
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    m = re.search(rb"(?im)^content-length: *(\d+)\r?$", head)
    return m is not None and len(body) >= int(m.group(1))


def parse_raw(buf: bytes) -> RawAnswer:
    buf = _split_interim(buf)
    head, sep, body = buf.partition(b"\r\n\r\n")
    assert sep, f"no complete answer: {buf[:300]!r}"
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.decode("latin-1").lower(), value.strip()))
    out = RawAnswer(status, headers, body)
    cl = out.get("content-length")
    if cl:
        out.body = body[: int(cl[0])]
    return out


def check_raw(got: RawAnswer, plain: tuple[int, ...] = (400,)) -> None:
    """The invariants of an answer to any bytes: no 5xx, errors as OpenAI JSON where JSON,
    else aiohttp's own plain-text answer (``plain``: 400 for what its HTTP parser refuses,
    the router never saw it), at most one valid X-Request-Id, and no header a client tried
    to inject."""
    assert got.status < 500, got
    ctype = b"".join(got.get("content-type"))
    rids = got.get("x-request-id")
    assert len(rids) <= 1 and all(RID_BYTES.fullmatch(r) for r in rids), got
    assert not got.get("x-evil"), got
    if got.status >= 400:
        if ctype.startswith(b"application/json"):
            assert set(error_of(got.body)) == ERROR_KEYS, got
        else:
            assert got.status in plain and ctype.startswith(b"text/plain"), got
            assert not rids, got


def request_bytes(
    path: str, body: bytes, headers: list[tuple[bytes, bytes]], length: bool = True
) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" % path.encode()
    for name, value in headers:
        head += name + b": " + value + b"\r\n"
    if length:
        head += b"Content-Length: %d\r\n" % len(body)
    return head + b"\r\n" + body


def chunks(body: bytes, size: int = 4096) -> bytes:
    parts = [body[i : i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


def chunked_request(path: str, body: bytes) -> bytes:
    hdrs = [(b"Content-Type", b"application/json"), (b"Transfer-Encoding", b"chunked")]
    return request_bytes(path, chunks(body) + b"0\r\n\r\n", hdrs, length=False)


SHORT_CHAT = json.dumps(_base(True, long=False)).encode()
HEADER_NAMES = [
    b"X-Request-Id",
    b"x-request-id",
    b"X-REQUEST-ID",
    b"x-session-id",
    b"Authorization",
    b"Content-Encoding",
    b"Content-Type",
    b"Accept",
    b"Cookie",
    b"X-Forwarded-For",
]
VCHAR = st.binary(max_size=60).filter(lambda v: all(32 <= b < 127 or b == 9 for b in v))
CONTROL = [b"\x00", b"\x01", b"\x0b", b"\x0c", b"\x1b", b"\x7f", b"\n", b"\r"]
ODD_VALUES = [  # content types and codings the router meets (it reads neither for JSON)
    b"",
    b"text/plain",
    b"application/x-www-form-urlencoded",
    b"multipart/form-data; boundary=zz",
    b"application/json; charset=utf-16",
    b"application/json; charset=\xff\xfe",
    b"*/*",
    b"application/jsonx",
    b"identity",
    b"IDENTITY",
    b" identity ",
    b"gzip",
    b"br",
    b"identity, gzip",
    b"\xc2\xa0identity",  # U+00A0 first: str.strip() removes it
]


@dataclass
class HeaderValue:
    raw: bytes  # as written after "Name: "
    value: bytes  # what the router reads (the part before an injected CRLF, OWS trimmed)


@st.composite
def header_values(draw: st.DrawFn) -> HeaderValue:
    """Values aiohttp's parser takes."""
    kind = draw(st.sampled_from(["token", "long", "vchar", "obs", "odd", "huge", "inject"]))
    token = draw(st.from_regex(RID_BYTES, fullmatch=True))
    if kind == "token":
        v = token
    elif kind == "long":  # a valid-looking id, too long to be kept
        v = b"a" * draw(st.integers(129, 4000))
    elif kind == "vchar":
        v = draw(VCHAR)
    elif kind == "obs":  # bytes that are not UTF-8 (RFC 9110 obs-text)
        v = draw(st.binary(min_size=1, max_size=40).map(lambda b: bytes(x | 0x80 for x in b)))
    elif kind == "odd":
        v = draw(st.sampled_from(ODD_VALUES))
    elif kind == "huge":  # under aiohttp's 8190-byte field limit
        v = b"h" * draw(st.integers(1000, 8000))
    else:  # CR/LF injection: it only makes a header of its own
        return HeaderValue(token + b"\r\nX-Evil: " + token, token)
    return HeaderValue(v, v.strip(b" \t"))


@st.composite
def refused_headers(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A header line aiohttp's parser refuses (400 before the router sees the request)."""
    name = draw(st.sampled_from(HEADER_NAMES))
    token = draw(st.from_regex(RID_BYTES, fullmatch=True))
    kind = draw(st.sampled_from(["over", "control", "fold", "singleton"]))
    if kind == "over":  # above the 8190-byte field limit
        return name, b"o" * draw(st.integers(8300, 12000))
    if kind == "control":  # NUL, other controls, DEL, a bare CR or LF
        return name, token + draw(st.sampled_from(CONTROL)) + b"x" + token
    if kind == "fold":  # obs-fold: a continuation line
        return name, token + b"\r\n " + token
    return b"Host", token  # a second one (request_bytes writes the first)


def _expected(headers: list[tuple[bytes, HeaderValue]]) -> int:
    coding = [h.value for n, h in headers if n.lower() == b"content-encoding"]
    if coding and coding[0].decode("utf-8", "surrogateescape").strip().lower() not in (
        "",
        "identity",
    ):
        return 415
    return 200


@SETTINGS
@given(
    headers=st.lists(st.tuples(st.sampled_from(HEADER_NAMES), header_values()), max_size=5),
    refused=st.none() | st.none() | st.none() | refused_headers(),
    position=st.integers(0, 5),
    path=st.sampled_from([CHAT, COMPLETIONS]),
    which=st.integers(0, 1),
)
def test_abused_headers(
    setup: Setup,
    headers: list[tuple[bytes, HeaderValue]],
    refused: tuple[bytes, bytes] | None,
    position: int,
    path: str,
    which: int,
) -> None:
    """Duplicate headers, values near and above aiohttp's 8190-byte limit, bytes that are not
    UTF-8, control characters, obs-fold and CR/LF injection (also in X-Request-Id), odd
    Content-Type and Content-Encoding: refused by the HTTP parser (400, plain text), or
    answered by the router, which never echoes an id it does not accept (it makes its own)
    and hands the engines the id it echoes."""
    body = SHORT_CHAT if path == CHAT else json.dumps(_base(False, long=False)).encode()
    hdrs = [(n, h.raw) for n, h in headers]
    if not any(n.lower() == b"content-type" for n, _ in headers):
        hdrs.append((b"Content-Type", b"application/json"))
    if refused is not None:
        hdrs.insert(position, refused)
    names = [n.lower() for n, _ in hdrs]
    engine_log(setup, clear=True)
    got = parse_raw(raw_exchange(setup.routers[which].port, request_bytes(path, body, hdrs)))
    check_raw(got)
    want = 400 if refused is not None or names.count(b"content-type") > 1 else _expected(headers)
    assert got.status == want, (got, want)
    if want == 400:
        assert got.get("content-type") == [b"text/plain; charset=utf-8"], got
        assert engine_log(setup) == []
        return
    sent = [h.value for n, h in headers if n.lower() == b"x-request-id"]
    (rid,) = got.get("x-request-id")
    if sent and RID_BYTES.fullmatch(sent[0]):
        assert rid == sent[0], got  # the first one, as sent
    else:
        assert GENERATED_RID.fullmatch(rid.decode()), got
    seen = engine_log(setup)
    if want == 200:
        assert seen and all(rec["x_request_id"] == rid.decode() for rec in seen), seen
    else:
        assert seen == [], seen


def _framing(body: bytes) -> dict[str, tuple[bytes, set[int]]]:
    """Request bytes with broken framing, and the answers each may get."""
    n = len(body)
    ct = (b"Content-Type", b"application/json")
    te = (b"Transfer-Encoding", b"chunked")
    good = chunks(body, 16)

    def cl(*values: bytes) -> list[tuple[bytes, bytes]]:
        return [ct, *((b"Content-Length", v) for v in values)]

    def req(hdrs: list[tuple[bytes, bytes]], payload: bytes) -> bytes:
        return request_bytes(CHAT, payload, hdrs, length=False)

    return {
        "content_length_short": (req(cl(b"%d" % (n - 10)), body), {400}),
        "content_length_long": (req(cl(b"%d" % (n + 50)), body), {408}),  # waits for more
        "content_length_twice": (req(cl(b"%d" % n, b"%d" % n), body), {400}),
        "content_length_differ": (req(cl(b"%d" % n, b"%d" % (n + 1)), body), {400}),
        "content_length_negative": (req(cl(b"-1"), body), {400}),
        "content_length_plus": (req(cl(b"+%d" % n), body), {400}),
        "content_length_hex": (req(cl(b"0x%x" % n), body), {400}),
        "content_length_list": (req(cl(b"%d, %d" % (n, n)), body), {400}),
        "content_length_overflow": (req(cl(b"9" * 30), body), {400}),
        "content_length_over_limit": (req(cl(b"%d" % (LIMIT + 1)), body), {413}),
        "content_length_zero": (req(cl(b"0"), body), {400}),
        "no_length": (req([ct], body), {400}),
        "chunked_and_content_length": (req([ct, te, *cl(b"%d" % n)[1:]], good), {400}),
        "chunked": (req([ct, te], good + b"0\r\n\r\n"), {200}),
        "chunked_upper_case": (
            req([ct, (b"Transfer-Encoding", b"CHUNKED")], good + b"0\r\n\r\n"),
            {200},
        ),
        "chunked_trailer": (req([ct, te], good + b"0\r\nX-Trailer: 1\r\n\r\n"), {200}),
        "chunked_extension": (req([ct, te], b"%x;a=b\r\n%s\r\n0\r\n\r\n" % (n, body)), {200}),
        "chunked_junk_size": (req([ct, te], b"zz\r\n" + body + b"\r\n0\r\n\r\n"), {400}),
        "chunked_negative_size": (req([ct, te], b"-5\r\nhello\r\n0\r\n\r\n"), {400}),
        "chunked_space_in_size": (req([ct, te], b"1 0\r\n" + body[:16] + b"\r\n0\r\n\r\n"), {400}),
        "chunked_size_overflow": (req([ct, te], b"f" * 20 + b"\r\n" + body + b"\r\n"), {400}),
        "chunked_data_longer": (req([ct, te], b"5\r\n" + body + b"\r\n0\r\n\r\n"), {400}),
        "chunked_no_crlf": (req([ct, te], b"%x\r\n%s0\r\n\r\n" % (n, body)), {400}),
        "chunked_control_in_extension": (req([ct, te], b"5;\x00\r\nhello\r\n0\r\n\r\n"), {400}),
        "chunked_unterminated": (req([ct, te], good), {408}),  # waits for the last chunk
        "chunked_junk_after_end": (req([ct, te], good + b"0\r\n\r\nGARBAGE"), {200, 400}),
        "transfer_encoding_twice": (req([ct, te, te], good + b"0\r\n\r\n"), {400}),
        "transfer_encoding_unknown": (req([ct, (b"Transfer-Encoding", b"xchunked")], body), {400}),
        "transfer_encoding_gzip_chunked": (
            req([ct, (b"Transfer-Encoding", b"gzip, chunked")], good + b"0\r\n\r\n"),
            {200, 400},
        ),
        "expect_continue": (
            req([ct, (b"Expect", b"100-continue"), *cl(b"%d" % n)[1:]], body),
            {200},
        ),
    }


FRAMING = _framing(SHORT_CHAT)


@pytest.mark.parametrize("case", sorted(FRAMING))
def test_broken_framing(routers: list[Proc], case: str) -> None:
    """Content-Length mismatches and junk in chunked bodies: refused by the HTTP parser,
    answered 400/408/413 by the router, or served when valid; never a 500 nor a hang (a body
    that never ends is answered 408 after timeouts.clientBodySeconds)."""
    data, allowed = FRAMING[case]
    for router in routers:
        got = parse_raw(raw_exchange(router.port, data))
        check_raw(got)
        assert got.status in allowed, (router.name, got)


# request line -> (status, JSON answer); what aiohttp refuses or routes nowhere is plain text
REQUEST_LINES: dict[bytes, tuple[int, bool]] = {
    b"POST /v1/chat/completions HTTP/1.0": (200, True),
    b"POST /v1/chat/%63ompletions HTTP/1.1": (200, True),  # percent-decoded: the route
    b"POST http://x/v1/chat/completions HTTP/1.1": (200, True),  # absolute form
    b"POST /v1/chat/completions?%ff=%fe HTTP/1.1": (200, True),
    b"POST /v1/chat/completions#frag HTTP/1.1": (200, True),
    b"POST /v1/chat/completions%00 HTTP/1.1": (404, True),
    b"POST /v1/chat/completions/ HTTP/1.1": (404, True),
    b"POST //v1/chat/completions HTTP/1.1": (404, True),
    b"POST /v1/../v1/chat/completions HTTP/1.1": (404, True),  # not normalized
    b"GET /%ff HTTP/1.1": (404, True),
    b"GET /%c0%af HTTP/1.1": (404, True),
    b"PUT /v1/chat/completions HTTP/1.1": (405, True),  # a known path: 405 with Allow
    b"TRACE / HTTP/1.1": (404, True),
    b"OPTIONS * HTTP/1.1": (404, False),  # aiohttp's own 404: no route can match "*"
    b"CONNECT x:1 HTTP/1.1": (404, False),
    b"GET /\xff HTTP/1.1": (400, False),
    b"G\x01T / HTTP/1.1": (400, False),
    b"BREW /v1/chat/completions HTTP/1.1": (400, False),
    b"POST /v1/chat/completions HTTP/1.1 junk": (400, False),
    b"POST /v1/chat/completions?" + b"a" * 9000 + b" HTTP/1.1": (400, False),
}


@pytest.mark.parametrize("line", sorted(REQUEST_LINES), ids=lambda v: ascii(v[:48]))
def test_odd_request_lines(routers: list[Proc], line: bytes) -> None:
    status, is_json = REQUEST_LINES[line]
    head = line + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    data = head + b"Content-Length: %d\r\n\r\n" % len(SHORT_CHAT) + SHORT_CHAT
    for router in routers:
        got = parse_raw(raw_exchange(router.port, data))
        check_raw(got, plain=(400, 404))
        assert got.status == status, got
        assert b"".join(got.get("content-type")).startswith(b"application/json") == is_json, got


# ---------------------------------------------------------------------- refusals a client reads

HUGE = 20 * 1024 * 1024  # a body 200 x limits.maxBodyBytes: far more than the sockets buffer


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_far_over_the_limit_gets_a_413_the_client_reads(
    routers: list[Proc], framing: str
) -> None:
    """A client writes its whole body before it reads the answer (http.client, httpx): the
    router answers 413 early and must keep reading and dropping the rest (a lingering close),
    or closing with bytes unread resets the connection and the client sees a broken pipe
    instead of the answer."""
    raw = _padded({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, HUGE)
    for router in routers:
        if framing == "content-length":
            status, _, data = post(router, CHAT, raw)
            assert status == 413, data[:300]
            assert error_of(data)["message"] == "request body too large"
        else:
            got = parse_raw(raw_exchange(router.port, chunked_request(CHAT, raw)))
            assert got.status == 413, got
            check_raw(got)


def _with_fields(count: int) -> bytes:
    """A short chat request of exactly ``count`` header fields."""
    pad = [(b"X-Pad-%d" % i, b"v") for i in range(count - 4)]  # Host, Connection, Content-*
    return request_bytes(CHAT, SHORT_CHAT, [(b"Content-Type", b"application/json"), *pad])


@pytest.mark.parametrize("count", [100, 101, 200])
def test_header_fields_over_max_headers_are_431(routers: list[Proc], count: int) -> None:
    """limits.maxHeaders (default 100, Envoy's): that many fields are served, one more is a
    plain-text 431 the client reads."""
    for router in routers:
        got = parse_raw(raw_exchange(router.port, _with_fields(count)))
        assert got.status == (200 if count <= 100 else 431), got
        check_raw(got, plain=(431,))


def test_an_unknown_models_404_quotes_a_bounded_prefix_of_its_name(routers: list[Proc]) -> None:
    """vLLM quotes the whole name; a megabyte of it would come back as a megabyte of error."""
    name = "m" * (LIMIT // 2)
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "hi"}]}).encode()
    for router in routers:
        status, _, data = post(router, CHAT, body)
        assert status == 404, data[:300]
        msg = error_of(data)["message"]
        assert msg == f"The model `{name[:256]}...` does not exist.", msg[:300]
        # negative control: a name within the bound is quoted whole
        status, _, data = post(router, CHAT, body.replace(name.encode(), b"m" * 256))
        assert error_of(data)["message"] == f"The model `{'m' * 256}` does not exist."


# ---------------------------------------------------------------------- afterwards


def test_routers_are_healthy_after_all_of_it(setup: Setup) -> None:
    """Runs last: both routers still alive, healthy and serving both routes, and neither
    logged an unhandled exception."""
    for router in setup.routers:
        assert router.popen.poll() is None, router.log_tail()
        assert http_call(router.url() + "/health", timeout=30)[0] == 200
        assert http_call(router.url() + "/ready", timeout=30)[0] == 200
        for long, route in ((False, "direct"), (True, "disaggregated")):
            for chat in (True, False):
                raw = json.dumps(_base(chat, long)).encode()
                status, hdrs, data = post(router, CHAT if chat else COMPLETIONS, raw)
                assert status == 200 and hdrs["x-pd-route"] == route, (status, hdrs, data[:300])
        log = router.log.read_text(errors="replace")
        assert "Traceback" not in log and "Error handling request" not in log, log[-4000:]
