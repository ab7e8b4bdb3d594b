"""The chart's monitors scrape: every target up (the protected prod router with the metrics token
the ServiceMonitor sends, and refused without it), and every series labelled with component,
release and namespace by the monitors' relabelings."""

from __future__ import annotations

import pytest

from tests.observability.livestack import LiveStack

pytestmark = pytest.mark.xdist_group("observability")
OURS = '{__name__=~"pd_router_.+|vllm:.+"}'


def _targets(live: LiveStack) -> list[dict]:
    p = live.prometheus
    assert p is not None
    return p.wait_for(
        lambda: [t for t in p.targets() if t["health"] != "unknown"] == p.targets() and p.targets(),
        "scraped every target",
        30,
    )


def test_every_target_the_monitors_keep_is_up(live: LiveStack) -> None:
    targets = [t for t in _targets(live) if not t["scrapePool"].endswith("/without-credentials")]
    # one router and one pod per engine role: the selectors and port filters keep exactly these
    assert sorted(t["labels"]["component"] for t in targets) == ["decode", "prefill", "router"]
    # the engines are scraped through their metrics-only proxy (engine.metricsProxy), never the API port
    assert {t["labels"]["container"] for t in targets if t["labels"]["component"] != "router"} == {"metrics-proxy"}
    for t in targets:
        assert t["health"] == "up", (t["scrapePool"], t["lastError"])


def test_the_protected_prod_router_is_scraped_with_the_metrics_token_only(stacks: dict[str, LiveStack]) -> None:
    live = stacks["prod"]
    assert live.metrics_token, "values/prod.yaml protects /metrics with a metrics token"
    by_pool = {t["scrapePool"]: t for t in _targets(live)}
    with_token = [
        t for p, t in by_pool.items() if p.startswith("serviceMonitor/") and not p.endswith("/without-credentials")
    ]
    without = [t for p, t in by_pool.items() if p.endswith("/without-credentials")]
    assert with_token and with_token[0]["health"] == "up", with_token
    assert without and without[0]["health"] == "down" and "401" in without[0]["lastError"], without


def test_every_series_carries_component_release_and_namespace(live: LiveStack) -> None:
    p = live.prometheus
    assert p is not None
    groups = p.wait_for(lambda: p.query(f"count by (component, release, namespace) ({OURS})"), "series", 30)
    labels = {(g["metric"].get("component"), g["metric"].get("release"), g["metric"].get("namespace")) for g in groups}
    assert labels == {(c, live.release, live.namespace) for c in ("router", "prefill", "decode")}


def test_the_simulated_engines_label_like_vllm(live: LiveStack) -> None:
    """vLLM 0.33 labels its metrics model_name (the served name) and engine (the engine index)."""
    p = live.prometheus
    assert p is not None
    got = p.wait_for(
        lambda: p.query("count by (component, model_name, engine) (vllm:num_requests_waiting)"), "series", 30
    )
    assert {(g["metric"]["component"], g["metric"]["model_name"], g["metric"]["engine"]) for g in got} == {
        ("prefill", live.model, "0"),
        ("decode", live.model, "0"),
    }
