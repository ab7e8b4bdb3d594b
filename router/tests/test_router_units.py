"""Small units: LMCache wire format, balancing, auth, sim determinism, request validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_router import balancing
from pd_router.auth import ApiKeys
from pd_router.config import ConfigError
from pd_router.discovery import Endpoint
from pd_router.handoff.lmcache_wire import decode_notif, encode_notif
from pd_router.openai_wire import validate
from pd_router_dev.sim import model as M


def test_proxy_notif_wire_format_matches_lmcache() -> None:
    # bytes LMCache 0.5.6 produces for ProxyNotif(req_id="abc") (pd-protocols.md section 1)
    expected = b"\x82\xa4type\xaaProxyNotif\xa6req_id\xa3abc"
    assert encode_notif("abc") == expected
    assert decode_notif(expected) == "abc"
    for bad in (
        b"\x82\xa4type\xa8OtherMsg\xa6req_id\xa3abc",
        b"\x82\xa4type\xa9OtherMsg\xa6req_id\xa3abc",
        b"\xff\x00garbage",
        b"",
        b"\x81\xa6req_id\x01",
    ):
        with pytest.raises(ValueError):
            decode_notif(bad)


def test_p2c_prefers_less_loaded() -> None:
    a, b = Endpoint("http://a:1"), Endpoint("http://b:1")
    a.active, b.active = 10, 0
    picks = {balancing.pick([a, b], balancing.decode_load).base for _ in range(50)}
    assert picks == {"http://b:1"}


def test_pick_exclude_and_empty() -> None:
    a, b = Endpoint("http://a:1"), Endpoint("http://b:1")
    assert balancing.pick([a, b], balancing.decode_load, exclude=[a]) is b
    assert balancing.pick([a], balancing.decode_load, exclude=[a]) is None
    assert balancing.pick([], balancing.decode_load) is None


def test_affinity_is_sticky_and_spreads() -> None:
    eps = [Endpoint(f"http://d{i}:1") for i in range(4)]
    first = balancing.pick(eps, balancing.decode_load, "session-1")
    for e in eps:
        e.active = 100 if e is first else 0
    assert balancing.pick(eps, balancing.decode_load, "session-1") is first
    chosen = {balancing.pick(eps, balancing.decode_load, f"s{i}").base for i in range(64)}
    assert len(chosen) > 1


def test_auth_keys(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("k1\n# comment\n\nk2\n")
    keys = ApiKeys(str(f), env={"PD_ROUTER_API_KEYS": "k3, k4"})
    assert keys.enabled
    for k in ("k1", "k2", "k3", "k4"):
        assert keys.check(f"Bearer {k}")
    for bad in (None, "", "Bearer", "Bearer nope", "Basic k1", "k1", "Bearer \udcff\udcfe"):
        assert not keys.check(bad)
    with pytest.raises(ConfigError, match=r"^auth\.apiKeysFile: "):
        ApiKeys(str(tmp_path / "missing"), env={})
    assert ApiKeys("", env={}).check(None)  # no keys: auth off


def test_sim_disaggregated_continuation_equals_direct() -> None:
    prompt = M.apply_chat_template([{"role": "user", "content": "hello there"}])
    g = M.Generator(prompt, ignore_eos=True)
    direct = [g.step() for _ in range(10)]
    g2 = M.Generator([*prompt, direct[0]], ignore_eos=True)
    assert [direct[0]] + [g2.step() for _ in range(9)] == direct


@pytest.mark.parametrize(
    ("body", "chat", "ok"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, True, True),
        ({"messages": []}, True, False),
        ({"messages": [{"content": "x"}]}, True, False),
        ({"messages": [{"role": "user", "content": 5}]}, True, False),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, True, False),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}, True, False),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, True, False),
        ({"prompt": "x"}, False, True),
        ({"prompt": [1, 2, 3]}, False, True),
        ({"prompt": [[1, 2], [3]]}, False, True),
        ({"prompt": [1, "a"]}, False, False),
        ({"prompt": 5}, False, False),
        ([], False, False),
        ({"prompt": "x", "model": 3}, False, False),
    ],
)
def test_validate(body: object, chat: bool, ok: bool) -> None:
    assert (validate(body, chat) is None) is ok


def test_preset_label_values_are_the_ones_the_router_records() -> None:
    """metrics.py creates these children at 0 at start-up; a value the router records but the preset
    lacks would be born at 1, an increase rate() and the chart's alerts never see."""
    import ast
    import re
    from pathlib import Path

    from pd_router import metrics

    pkg = Path(metrics.__file__).parent
    src = "\n".join(f.read_text() for f in sorted(pkg.rglob("*.py")))
    # every reason the runtime names: Fallback("x") raised, outcomes.fallback(ctx, "x") relabelled
    reasons = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[-1], ast.Constant):
            f = node.func
            name = getattr(f, "id", None) or getattr(f, "attr", "")
            if name in ("Fallback", "fallback"):
                reasons.add(node.args[-1].value)
    named = {"unsupported_fields", "too_long", "decode_retry", "notify_timeout", "prefill_refused"}
    assert named <= reasons
    assert reasons <= set(metrics.FALLBACK_REASONS), reasons - set(metrics.FALLBACK_REASONS)
    assert set(metrics.CLIENT_CAUSED) <= set(metrics.FALLBACK_REASONS)
    preset = metrics.Metrics().render().decode()
    for reason in metrics.FALLBACK_REASONS:  # the typed list is what metrics.py presets
        assert f'pd_router_fallbacks_total{{reason="{reason}"}} 0.0' in preset, reason
    assert set(re.findall(r'rejected\.labels\("(\w+)"\)', src)) == set(metrics.REJECT_REASONS)
    decide_src = (pkg / "decide.py").read_text()
    decided = set(re.findall(r'reason, disagg = "(\w+)"', decide_src))
    decided |= set(re.findall(r'Decision\((?:True|False), "skipped", "(\w+)"\)', decide_src))
    decided |= set(re.findall(r'"(\w+_threshold)" if long', decide_src))
    decided |= {"above_threshold", "below_threshold"}
    decided |= set(re.findall(r'Choice\(\w+, "(\w+)"\)', (pkg / "plan.py").read_text()))
    assert decided == {reason for _, reason in metrics.DECIDED}, decided
    text = metrics.Metrics().render().decode()
    assert 'pd_router_decisions_total{reason="prefix_cached",route="direct"} 0.0' in text
    assert 'pd_router_fallbacks_total{reason="notify_timeout"} 0.0' in text
    assert 'pd_router_requests_total{outcome="rejected",route="none"} 0.0' in text
    m = metrics.Metrics()
    m.preset_lmcache("prefillSidecar")
    text = m.render().decode()
    for kind in ("notify_timeout", "sidecar_error"):
        assert f'pd_router_upstream_errors_total{{kind="{kind}",pool="prefill"}} 0.0' in text


@pytest.mark.parametrize(
    ("raw", "deep"),
    [
        (b"[" * 128 + b"]" * 128, False),
        (b"[" * 129 + b"]" * 129, True),
        (b'{"a": [' + b"{}," * 500 + b"{}]}", False),  # many brackets, 3 levels
        (b'{"a": "' + b"[" * 1000 + b'"}', False),  # brackets inside a string
        (b'{"a": [1, {"b": ' + b"[" * 127 + b"]" * 127 + b"}]}", True),  # 130 levels
    ],
)
def test_too_deep(raw: bytes, deep: bool) -> None:
    import orjson

    from pd_router.openai_wire import too_deep

    assert too_deep(raw, orjson.loads(raw)) is deep


def _record(msg: str, level: int = 30, name: str = "pd_router") -> object:
    import logging

    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_rate_limit_per_template_with_suppressed_count() -> None:
    from pd_router.logs import RateLimit

    now = [0.0]
    rl = RateLimit(limit=3, window=10, clock=lambda: now[0])
    passed = [rl.filter(_record("a %s")) for _ in range(5)]  # type: ignore[arg-type]
    assert passed == [True, True, True, False, False]
    assert rl.filter(_record("other %s"))  # type: ignore[arg-type]  # its own budget
    assert rl.filter(_record("a %s", level=20))  # type: ignore[arg-type]  # info: never limited
    now[0] = 10.0  # the next window: the first record reports what was dropped
    first = _record("a %s")
    assert rl.filter(first)  # type: ignore[arg-type]
    assert first.suppressed == 2  # type: ignore[attr-defined]
    second = _record("a %s")
    assert rl.filter(second) and not hasattr(second, "suppressed")  # type: ignore[arg-type]


def test_exception_summary_has_frames_but_no_message() -> None:
    import json
    import logging
    import sys

    from pd_router.logs import JsonFormatter, exc_summary

    def fail() -> None:
        raise ValueError("secret-in-message")

    try:
        try:
            fail()
        except ValueError as e:
            raise KeyError("secret-key") from e
    except KeyError:
        info = sys.exc_info()
    text = exc_summary(info)  # type: ignore[arg-type]
    assert "secret" not in text
    assert text.startswith("KeyError at ") and "; caused by ValueError at " in text
    assert f"{__file__}:" in text and " in fail" in text
    rec = logging.LogRecord("aiohttp.server", 40, __file__, 1, "x %s", (info[1],), info)
    out = json.loads(JsonFormatter().format(rec))
    assert out["msg"] == "x KeyError" and "secret" not in json.dumps(out)


def test_request_ids_match_whole_values_only() -> None:
    from pd_router.app import _RID_RE

    assert (
        _RID_RE.fullmatch("abc-123")
        and not _RID_RE.fullmatch("abc\n")
        and not _RID_RE.fullmatch("a" * 129)
    )
