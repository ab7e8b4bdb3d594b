"""The chart's monitoring on the real engines: a real Prometheus scrapes the real prefiller and
decoder through the chart's metrics-only proxy, with the scrape configs the Prometheus Operator
would make of the dev environment's PodMonitor and ServiceMonitor and its PrometheusRule loaded.
The KV-transfer panels of the dashboard return the real engines' series, and the silent
decode-only alert (PDInferenceKVTransferStalled) is quiet while KV flows and fires, in promtool,
on series that carry the real engines' own label sets once it stops."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import helm
from tests.cases import LAYERINGS
from tests.observability import prom
from tests.observability.livestack import ROLES, LiveStack
from tests.observability.prom import DASHBOARD
from tests.real_engine import engines
from tests.real_engine.prompts import LONG_WORDS, SHORT_WORDS, ask, text

MONITORED = (
    "metrics.podMonitor.enabled=true",
    "metrics.serviceMonitor.enabled=true",
    "metrics.prometheusRule.enabled=true",
    "crds.assumeInstalled=true",
)
STALLED = "PDInferenceKVTransferStalled"


class RealLiveStack(LiveStack):
    """The observability tier's live stack with the real engines instead of simulated ones."""

    def __init__(self, name: str, docs: list[dict[str, Any]], workdir: Path, real: dict[str, engines.Engine]) -> None:
        super().__init__(name, docs, workdir)
        self.real = real

    def start_engines(self, env: dict[str, str]) -> dict[str, Any]:
        return dict(self.real)

    def engine_url(self, role: str) -> str:
        return self.real[role].url

    def drive(self) -> dict[str, int]:
        """Short and long prompts, each long one new from its first block (so its KV moves)."""
        routes: dict[str, int] = {}
        for i in range(3):
            for words in (SHORT_WORDS, LONG_WORDS):
                got = ask(self.router.url(), self.model, True, text(f"obs-{i}-{words}", words), bool(i % 2))
                routes[got.route] = routes.get(got.route, 0) + 1
        return routes


@pytest.fixture(scope="module")
def live(pd: dict[str, engines.Engine], workdir: Path) -> Iterator[RealLiveStack]:
    prom.require_tools()
    work = workdir / "observability"
    work.mkdir(exist_ok=True)
    docs = helm.render(helm.helm_binaries()[0], LAYERINGS[engines.RENDER], MONITORED)
    rules = work / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": helm.one(docs, "PrometheusRule")["spec"]["groups"]}, sort_keys=False))
    s = RealLiveStack("real", docs, work, pd)
    try:
        s.start()
        p = s.start_prometheus([rules])
        p.wait_for(lambda: bool(p.targets()) and all(t["health"] == "up" for t in p.targets()), "every target up", 60)
        s.routes = s.drive()  # type: ignore[attr-defined]
        yield s
    finally:
        s.stop()


def _query(live: RealLiveStack, expr: str, what: str) -> list[dict[str, Any]]:
    p = live.prometheus
    assert p is not None
    return p.wait_for(lambda: p.query(expr), what, 60)


def test_the_traffic_was_disaggregated(live: RealLiveStack) -> None:
    assert live.routes == {"direct": 3, "disaggregated": 3}  # type: ignore[attr-defined]


def test_the_kv_transfer_panels_show_the_real_engines_transfers(live: RealLiveStack) -> None:
    board = json.loads(DASHBOARD.read_text())
    panels = [
        (p["title"], t["expr"])
        for p in board["panels"]
        for t in p.get("targets", [])
        if re.search(r"nixl_|external_kv_transfer|prompt_tokens_by_source", t["expr"])
    ]
    assert len(panels) >= 2
    for title, expr in panels:
        q = (
            expr.replace("$namespace", live.namespace)
            .replace("$release", live.release)
            .replace("$__rate_interval", "5m")
        )
        assert _query(live, q, f"panel {title!r}"), f"{title}: no data for {q}"


def _rule(live: RealLiveStack, name: str) -> dict[str, Any]:
    return next(
        r for g in helm.one(live.docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"] if r["alert"] == name
    )


def test_the_silent_decode_only_alert_is_quiet_while_kv_flows(live: RealLiveStack) -> None:
    rule = _rule(live, STALLED)
    # both sides of the `unless` hold on the real series: the router completes disaggregated
    # requests, and the decoder counts prompt tokens that came over NIXL
    left, right = rule["expr"].split("\nunless on (namespace, release)\n")
    assert _query(live, left, "the router's disaggregated answers")
    ext = _query(live, right, "the decoder's external KV")
    assert ext[0]["metric"] == {"namespace": live.namespace, "release": live.release}
    p = live.prometheus
    assert p is not None and p.query(rule["expr"]) == []


def test_the_silent_decode_only_alert_fires_on_the_real_series_when_kv_stops(
    live: RealLiveStack, tmp_path: Path
) -> None:
    """promtool over 40 minutes of the two input series, each with the full label set the real
    scrape gave it: the router keeps completing disaggregated requests while the decoder's
    external KV counter stops (firing) or keeps growing (healthy)."""
    p = live.prometheus
    assert p is not None
    rule = _rule(live, STALLED)

    def labels(selector: str) -> str:
        (series, *_) = p.wait_for(lambda: p.api("series", **{"match[]": selector}), selector, 60)
        name = series.pop("__name__")
        return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(series.items())) + "}"

    req = labels('pd_router_requests_total{route="disaggregated",outcome="ok"}')
    ext = labels('vllm:prompt_tokens_by_source_total{component="decode",source="external_kv_transfer"}')
    assert 'pod="' in ext and f'release="{live.release}"' in ext and 'model_name="' in ext
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "pd", "rules": [rule]}]}))
    tests = []
    for scenario, ext_values in (("firing", "900x40"), ("healthy", "900+4000x40")):
        alerts = [{"exp_labels": {"namespace": live.namespace, "release": live.release, **rule["labels"]}}]
        tests.append({
            "name": scenario, "interval": "1m",
            "input_series": [{"series": req, "values": "0+5x40"}, {"series": ext, "values": ext_values}],
            "alert_rule_test": [{"eval_time": "35m", "alertname": STALLED, "exp_alerts": alerts if scenario == "firing" else []}],
        })  # fmt: skip
    for t in tests:  # promtool compares annotations only when given: labels are what matter here
        for a in t["alert_rule_test"][0]["exp_alerts"]:
            a["exp_annotations"] = {
                k: v.replace("{{ $labels.namespace }}", live.namespace).replace("{{ $labels.release }}", live.release)
                for k, v in rule["annotations"].items()
            }
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "tests": tests}, sort_keys=False)
    )
    out = prom.promtool("test", "rules", str(tmp_path / "tests.yaml"))
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_engine_series_carries_component_release_and_namespace(live: RealLiveStack) -> None:
    p = live.prometheus
    assert p is not None
    for role in ROLES:
        series = p.api("series", **{"match[]": f'vllm:num_requests_running{{component="{role}"}}'})
        assert series and all(s["release"] == live.release and s["namespace"] == live.namespace for s in series)
