"""Every PromQL expression the chart ships returns data from the live stack: the autoscalers'
queries, the dashboard's panel targets, and every selector of every alert (an alert's whole
expression is empty while healthy; test_rules.py fires each one)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests import helm
from tests.observability.livestack import LiveStack
from tests.observability.prom import DASHBOARD

pytestmark = pytest.mark.xdist_group("observability")
SECONDS = 30  # how long a query may take to see the traffic's scrapes before it counts as empty


def _non_empty(live: LiveStack, expr: str) -> list[dict]:
    p = live.prometheus
    assert p is not None
    try:
        return p.wait_for(lambda: p.query(expr), "non-empty", SECONDS)
    except AssertionError:
        raise AssertionError(f"{live.name}: no data for {expr}") from None


def autoscaler_queries(live: LiveStack) -> list[str]:
    out = []
    for so in helm.find(live.docs, "ScaledObject"):
        out += [t["metadata"]["query"] for t in so["spec"]["triggers"] if t["type"] == "prometheus"]
    return out + adapter_queries(live)


def test_each_environment_autoscales_on_its_own_queue(stacks: dict[str, LiveStack]) -> None:
    prod = stacks["prod"]
    sel = f'namespace="{prod.namespace}",release="{prod.release}",component="decode"'
    assert autoscaler_queries(prod) == [f"sum(vllm:num_requests_waiting{{{sel}}})"]
    kinds = {d["kind"] for d in stacks["lmcache"].docs if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")}
    assert kinds == {"ScaledObject", "HorizontalPodAutoscaler"}
    assert len(adapter_queries(stacks["lmcache"])) == 1


def test_autoscaler_queries_return_the_queue_of_this_release(live: LiveStack) -> None:
    queries = autoscaler_queries(live)
    assert queries
    for q in queries:
        (sample,) = _non_empty(live, q)
        assert float(sample["value"][1]) >= 0
        assert f'namespace="{live.namespace}"' in q and f'release="{live.release}"' in q


def dashboard_targets() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def applies(expr: str, connector: str) -> bool:
    """LMCache panels need the LMCache connector, NIXL panels the NixlConnector."""
    if "lmcache" in expr:
        return connector == "lmcache"
    return "nixl_" not in expr or connector == "nixl"


def test_every_dashboard_selector_is_scoped_to_one_release(stacks: dict[str, LiveStack]) -> None:
    """Every selector of every panel target and variable (parsed by Prometheus) carries the
    namespace and release variables, so one release's panels never add in another's series."""
    p = stacks["prod"].prometheus
    assert p is not None
    board = json.loads(DASHBOARD.read_text())
    exprs = [e for _, e in dashboard_targets()]
    exprs += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    for expr in exprs:
        q = re.sub(r"label_values\((.*), \w+\)$", r"\1", expr)  # a variable's query: its selector
        q = q.replace("$namespace", "NS").replace("$release", "REL").replace("$__rate_interval", "5m")
        for sel in p.selectors(q):
            if expr == "label_values(pd_router_endpoints, namespace)":
                continue  # the namespace variable lists every namespace
            assert 'namespace="NS"' in sel, (expr, sel)
            if "release)" not in expr:  # the release variable lists the namespace's releases
                assert 'release="REL"' in sel, (expr, sel)


def adapter_queries(live: LiveStack) -> list[str]:
    """What prometheus-adapter runs for the chart's HPA External metrics, with the rule docs/operating.md
    gives (its metricsQuery template expanded as the adapter does)."""
    readme = (helm.ROOT / "docs" / "operating.md").read_text()
    block = re.search(r"```yaml\n# prometheus-adapter values: rules.external\n(.*?)```", readme, re.S)
    assert block, "docs/operating.md: the prometheus-adapter rule block"
    (rule,) = yaml.safe_load(block.group(1))
    out = []
    for hpa in helm.find(live.docs, "HorizontalPodAutoscaler"):
        for m in hpa["spec"]["metrics"]:
            if m["type"] != "External":
                continue
            metric = m["external"]["metric"]
            assert metric["name"] == rule["name"]["as"]
            matchers = ",".join(f'{k}="{v}"' for k, v in metric["selector"]["matchLabels"].items())
            series = rule["seriesQuery"].split("{")[0].strip("'")
            out.append(rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers))
    return out


def test_every_dashboard_query_returns_data(live: LiveStack) -> None:
    checked = 0
    for _title, expr in dashboard_targets():
        if not applies(expr, live.connector):
            continue
        q = (
            expr.replace("$namespace", live.namespace)
            .replace("$release", live.release)
            .replace("$__rate_interval", "5m")
        )
        _non_empty(live, q)
        checked += 1
    assert checked >= 30, checked


def test_every_panel_is_proven_by_some_environment(stacks: dict[str, LiveStack]) -> None:
    unproven = [t for t, e in dashboard_targets() if not any(applies(e, s.connector) for s in stacks.values())]
    assert not unproven


def alert_rules(live: LiveStack) -> list[dict]:
    rule = helm.one(live.docs, "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]


def test_every_selector_of_every_alert_matches_live_series(live: LiveStack) -> None:
    p = live.prometheus
    assert p is not None
    for rule in alert_rules(live):
        selectors = p.selectors(rule["expr"])
        assert selectors, rule["alert"]
        for sel in selectors:
            _non_empty(live, sel)


def test_the_rules_load_and_evaluate_in_prometheus(live: LiveStack) -> None:
    p = live.prometheus
    assert p is not None

    def evaluated() -> list[dict]:
        rules = [r for g in p.api("rules")["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else []

    rules = p.wait_for(evaluated, "rules evaluated", SECONDS)
    assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in alert_rules(live))
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


# What the live traffic makes true on purpose: two fallbacks among six long prompts (a third),
# one rejection among a dozen requests. Every other alert must be silent on it.
TRIGGERED = {"PDInferenceFallbackShareHigh", "PDInferenceRouterRejecting", "PDInferenceLMCacheNotificationTimeouts"}


def test_alert_expressions_hold_exactly_where_the_traffic_made_them_true(live: LiveStack) -> None:
    p = live.prometheus
    assert p is not None
    for rule in alert_rules(live):
        if rule["alert"] in TRIGGERED:
            _non_empty(live, rule["expr"])
        else:
            # The stack has served disaggregated requests whose KV the decoder received, so the
            # silent-decode-only detector in particular must not hold.
            _non_empty(
                live, f'sum(rate(pd_router_requests_total{{route="disaggregated",release="{live.release}"}}[10m])) > 0'
            )
            assert p.query(rule["expr"]) == [], rule["alert"]
