"""The KV hand-off connectors are listed once on each side: the chart's templates/_connectors.tpl
and the router's pd_router/connectors.py. Both lists name the same connectors, agree on the
facts both keep, and so do the schema's enum, the chart's default and the engine preflight's
--connector; each connector the chart lists renders."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from pd_router.connectors import CONNECTORS, DEFAULT, NAMES

from tests import helm
from tests.cases import LMCACHE

CHART_VALUES = helm.CHART / "values.yaml"
PREFLIGHT = helm.CHART / "files" / "preflight.py"
# The chart's fact -> the router's, for the facts both keep; a reason counts as true.
SHARED_FACTS = {
    "fixedRoles": "fixed_roles",
    "goodput": "goodput",
    "notifications": "notifications",
    "noLora": "no_lora",
}


@pytest.fixture(scope="module")
def chart_connectors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """pd-inference.connectors as the chart renders it, through a copy of the chart with one
    template more that prints it."""
    chart = tmp_path_factory.mktemp("connectors") / "pd-inference"
    shutil.copytree(helm.CHART, chart)
    (chart / "templates" / "zz-connectors.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: connectors\n"
        'data:\n  connectors.json: {{ include "pd-inference.connectors" . | quote }}\n'
    )
    h4 = helm.helm_binaries()[0]
    result = helm.template(h4, chart=chart, extra=("--show-only", "templates/zz-connectors.yaml"))
    assert result.returncode == 0, result.stderr
    (doc,) = result.docs
    return json.loads(doc["data"]["connectors.json"])


def preflight_choices() -> list[str]:
    """The --connector choices of files/preflight.py (it runs in the engine image, without the chart)."""
    for node in ast.walk(ast.parse(PREFLIGHT.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "--connector"
        ):
            (choices,) = [k.value for k in node.keywords if k.arg == "choices"]
            return ast.literal_eval(choices)
    raise AssertionError(f"{PREFLIGHT}: no --connector argument")


def test_chart_and_router_list_the_same_connectors(chart_connectors: dict[str, Any]) -> None:
    schema = json.loads((helm.CHART / "values.schema.json").read_text())
    enum = schema["properties"]["kvTransfer"]["properties"]["connector"]["enum"]
    assert sorted(chart_connectors) == list(NAMES), "templates/_connectors.tpl vs pd_router/connectors.py"
    assert enum == list(NAMES), "values.schema.json is stale: make docs"
    assert sorted(preflight_choices()) == list(NAMES), "files/preflight.py --connector choices"


def test_chart_and_router_agree_on_the_facts_both_keep(chart_connectors: dict[str, Any]) -> None:
    chart = chart_connectors
    facts = {name: set(entry) for name, entry in chart.items()}
    assert len({frozenset(f) for f in facts.values()}) == 1, f"every entry states every fact: {facts}"
    differ = {
        (name, fact): (chart[name][fact], getattr(CONNECTORS[name], attr))
        for name in NAMES
        for fact, attr in SHARED_FACTS.items()
        if bool(chart[name][fact]) != bool(getattr(CONNECTORS[name], attr))
    }
    assert not differ, differ


def test_chart_and_router_default_to_the_same_connector() -> None:
    values = yaml.safe_load(CHART_VALUES.read_text())
    assert values["kvTransfer"]["connector"] == DEFAULT


@pytest.mark.parametrize("name", NAMES)
def test_each_connector_renders(h4: Path, name: str) -> None:
    """Its pieces (kvTransferConfig, env, ports, alerts) exist: a full-attention model, which
    every connector serves, with the alerts on."""
    sets = (
        f"kvTransfer.connector={name}",
        "metrics.prometheusRule.enabled=true",
        "metrics.podMonitor.enabled=true",
        "metrics.serviceMonitor.enabled=true",
    )
    docs = helm.render(h4, (LMCACHE,), sets)
    config = yaml.safe_load(helm.one(docs, "ConfigMap", "-router")["data"]["router.yaml"])
    assert config["routing"]["connector"] == name
