"""The PrometheusRule with promtool: `check rules` on what the chart renders, and `test rules`
where each alert fires in its scenario and stays silent when healthy. The input series take their
names and full label sets from the live stack's scrape (so a label the monitors do not set, or a
metric the engines do not export, cannot be papered over by the test), with only the labels a
scenario varies (route, outcome, source, ...) changed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import helm
from tests.observability import prom
from tests.observability.livestack import LiveStack

pytestmark = pytest.mark.xdist_group("observability")

REQ = "pd_router_requests_total"
EXT = 'vllm:prompt_tokens_by_source_total{component="decode",source="external_kv_transfer"}'
REV = "0a1b2c3d4e"  # a KV revision (pd_router.revision)
# alert -> scenario -> [(live selector to copy labels from, values every minute)]; 40 minutes.
# An input may name labels to change in what it copies: (selector, values, {label: value}).
SCENARIOS: dict[str, dict[str, list[tuple[str, str] | tuple[str, str, dict[str, str]]]]] = {
    "PDInferenceKVTransferStalled": {
        "firing": [(f'{REQ}{{route="disaggregated",outcome="ok"}}', "0+5x40"), (EXT, "900x40")],
        "healthy": [(f'{REQ}{{route="disaggregated",outcome="ok"}}', "0+5x40"), (EXT, "900+4000x40")],
    },
    "PDInferenceFallbackShareHigh": {
        "firing": [(f'{REQ}{{route="disaggregated",outcome="ok"}}', "0+2x40"), (f'{REQ}{{route="fallback",outcome="ok"}}', "0+3x40"),
                   ('pd_router_fallbacks_total{reason="prefill_error"}', "0+3x40")],
        # many fallbacks, but caused by the requests (a field PD cannot carry): not a PD failure
        "healthy": [(f'{REQ}{{route="disaggregated",outcome="ok"}}', "0+3x40"), (f'{REQ}{{route="fallback",outcome="ok"}}', "0+5x40"),
                    ('pd_router_fallbacks_total{reason="prefill_error"}', "0+1x40"),
                    ('pd_router_fallbacks_total{reason="unsupported_fields"}', "0+4x40")],
    },
    "PDInferenceLMCacheNotificationTimeouts": {
        "firing": [(f'{REQ}{{route="disaggregated",outcome="ok"}}', "0+10x40"), ('pd_router_fallbacks_total{reason="notify_timeout"}', "0+2x40")],
        "healthy": [(f'{REQ}{{route="disaggregated",outcome="ok"}}', "0+10x40"), ('pd_router_fallbacks_total{reason="notify_timeout"}', "1x40")],
    },
    "PDInferenceNixlTransferFailures": {
        "firing": [('vllm:nixl_num_failed_transfers_total{component="decode"}', "0+1x40")],
        "healthy": [('vllm:nixl_num_failed_transfers_total{component="decode"}', "3x40")],
    },
    # its `for` (thresholds.noRevisionPairFor, 1h) outlasts the others: 100 minutes of series
    "PDInferenceNoRevisionPair": {
        "firing": [('pd_router_fallbacks_total{reason="no_revision_pair"}', "0+1x100")],
        # a rollout's worth of them, then none: over
        "healthy": [('pd_router_fallbacks_total{reason="no_revision_pair"}', "0+1x20 20x80")],
    },
    # two weight sets under one revision (the second series is the first's, its weights label
    # changed: the live stack's engines all hold one; they are the simulator, which serves no
    # revision, so the label a chart's engine has is set too)
    "PDInferenceWeightsDiffer": {
        "firing": [('pd_router_weight_set_endpoints{pool="decode"}', "1x40", {"revision": REV}),
                   ('pd_router_weight_set_endpoints{pool="decode"}', "1x40", {"revision": REV, "weights": "1"})],
        # an engine of other weights replaced: its set reads 0
        "healthy": [('pd_router_weight_set_endpoints{pool="decode"}', "2x40", {"revision": REV}),
                    ('pd_router_weight_set_endpoints{pool="decode"}', "1x2 0x38", {"revision": REV, "weights": "1"})],
    },
    "PDInferenceNoHealthyDecoder": {
        "firing": [('pd_router_healthy_endpoints{pool="decode"}', "0x40")],
        "healthy": [('pd_router_healthy_endpoints{pool="decode"}', "1x40")],
    },
    "PDInferenceNoHealthyPrefiller": {
        "firing": [('pd_router_healthy_endpoints{pool="prefill"}', "0x40")],
        "healthy": [('pd_router_healthy_endpoints{pool="prefill"}', "2x40")],
    },
    # three stalls in the 15 minutes before EVAL_AT, against two seen by each of two routers
    "PDInferenceEngineStalls": {
        "firing": [('pd_router_engine_stalls_total{pool="decode"}', "0x24 1 1 1 2 2 2 3x10")],
        "healthy": [('pd_router_engine_stalls_total{pool="decode"}', "0x24 1 1 1 1 1 1 2x10"),
                    ('pd_router_engine_stalls_total{pool="decode"}', "0x24 1 1 1 1 1 1 2x10",
                     {"pod": "second-router", "instance": "127.0.0.9:8080"})],
    },
    "PDInferenceRouterRejecting": {
        "firing": [(f'{REQ}{{route="direct",outcome="ok"}}', "0+50x40"), (f'{REQ}{{route="none",outcome="rejected"}}', "0+5x40")],
        "healthy": [(f'{REQ}{{route="direct",outcome="ok"}}', "0+50x40"), (f'{REQ}{{route="none",outcome="rejected"}}', "2x40")],
    },
    "PDInferencePrefillPoolSaturated": {
        "firing": [('pd_router_decisions_total{route="direct",reason="prefill_busy"}', "0+4x40"),
                   ('pd_router_decisions_total{route="disaggregated",reason="above_threshold"}', "0+6x40")],
        "healthy": [('pd_router_decisions_total{route="direct",reason="prefill_busy"}', "0+1x40"),
                    ('pd_router_decisions_total{route="disaggregated",reason="above_threshold"}', "0+9x40")],
    },
    "PDInferenceKVCacheNearFull": {
        "firing": [('vllm:kv_cache_usage_perc{component="decode"}', "0.99x40")],
        "healthy": [('vllm:kv_cache_usage_perc{component="decode"}', "0.5x40")],
    },
    "PDInferenceQueueHigh": {
        "firing": [('vllm:num_requests_waiting{component="decode"}', "100x40")],
        "healthy": [('vllm:num_requests_waiting{component="decode"}', "3x40")],
    },
}  # fmt: skip
EVAL_AT = "35m"  # past every alert's window plus its `for` ...


def _eval_at(rule: dict[str, Any]) -> str:
    """... or, for an alert whose `for` is longer than 20 minutes, 15 minutes past it."""
    m = re.fullmatch(r"(\d+)([mh])", str(rule.get("for", "")))
    minutes = int(m[1]) * (60 if m[2] == "h" else 1) if m else 0
    return f"{minutes + 15}m" if minutes > 20 else EVAL_AT


def _rules(live: LiveStack) -> list[dict[str, Any]]:
    return [r for g in helm.one(live.docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]


def test_promtool_checks_the_rendered_rules(live: LiveStack, tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": helm.one(live.docs, "PrometheusRule")["spec"]["groups"]}))
    proc = prom.promtool("check", "rules", str(path))
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_every_alert_has_a_scenario(live: LiveStack) -> None:
    missing = [r["alert"] for r in _rules(live) if r["alert"] not in SCENARIOS]
    assert not missing, f"add a firing and a healthy scenario for {missing}"


VALUE_TEMPLATE = re.compile(r"\{\{\s*\$value[^}]*\}\}")


def _expand(template: str, labels: dict[str, str], alert: str) -> str:
    def label(m: re.Match[str]) -> str:
        assert m.group(1) in labels, f"{alert}: an annotation uses $labels.{m.group(1)}, which the alert does not carry"
        return labels[m.group(1)]

    return re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", label, template)


def _live_labels(live: LiveStack, selector: str) -> dict[str, str]:
    p = live.prometheus
    assert p is not None
    series = p.wait_for(lambda: p.api("series", **{"match[]": selector}), f"series {selector}", 30)
    labels = dict(series[0])
    return {k: v for k, v in labels.items() if k not in ("instance",)} | {"instance": series[0]["instance"]}


def _series(labels: dict[str, str]) -> str:
    name = labels.pop("__name__")
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def test_each_alert_fires_in_its_scenario_and_not_when_healthy(live: LiveStack, tmp_path: Path) -> None:
    rules = _rules(live)
    # $value's rendering depends on float formatting: it is replaced by a marker; every
    # {{ $labels.x }} stays, so an annotation naming a label the aggregation dropped renders ""
    # and fails the exact comparison below.
    for r in rules:
        r["annotations"] = {k: VALUE_TEMPLATE.sub("VALUE", v) for k, v in r["annotations"].items()}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "pd", "rules": rules}]}, sort_keys=False))
    tests = []
    for rule in rules:
        by = re.search(r"by \(([^)]*)\)", rule["expr"])
        assert by, rule["alert"]
        keys = [k.strip() for k in by.group(1).split(",")]
        for scenario, inputs in SCENARIOS[rule["alert"]].items():
            series = []
            first: dict[str, str] = {}
            for selector, values, *changed in inputs:
                labels = _live_labels(live, selector) | (changed[0] if changed else {})
                first = first or dict(labels)
                series.append({"series": _series(labels), "values": values})
            expected = []
            if scenario == "firing":
                exp_labels = {**{k: first[k] for k in keys}, **rule["labels"]}
                annotations = {k: _expand(v, exp_labels, rule["alert"]) for k, v in rule["annotations"].items()}
                expected = [{"exp_labels": exp_labels, "exp_annotations": annotations}]
            tests.append({
                "name": f"{rule['alert']} {scenario}",
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [{"eval_time": _eval_at(rule), "alertname": rule["alert"], "exp_alerts": expected}],
            })  # fmt: skip
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": tests}, sort_keys=False)
    )
    proc = prom.promtool("test", "rules", str(tmp_path / "tests.yaml"))
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr
    assert len(tests) == 2 * len(rules)
