"""Generated and committed artefacts are current."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from tests import helm, snapshot


def test_default_render_matches_snapshot() -> None:
    expected, actual = snapshot.SNAPSHOT.read_text(), snapshot.current()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), "snapshot", "render", n=1))
    assert not diff, f"default render changed; review and run `make snapshot`:\n{diff[:4000]}"


def test_schema_and_readme_are_generated_from_values_yaml() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ci.chartdoc", "--check"], cwd=helm.ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_every_schema_property_has_a_description() -> None:
    import json

    schema = json.loads((helm.CHART / "values.schema.json").read_text())
    missing = []

    def walk(node: dict, path: str) -> None:
        for key, child in node.get("properties", {}).items():
            if not child.get("description"):
                missing.append(f"{path}{key}")
            walk(child, f"{path}{key}.")

    walk(schema, "")
    assert not missing


def test_chart_owned_objects_are_closed() -> None:
    import json

    schema = json.loads((helm.CHART / "values.schema.json").read_text())
    open_objects = []

    def walk(node: dict, path: str) -> None:
        if "properties" in node and node.get("additionalProperties") is not False:
            open_objects.append(path or "<root>")
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}{key}.")

    walk(schema, "")
    assert not open_objects


# --- schema hints (`# @schema` in values.yaml, parsed by ci/chartdoc.py) -------------------------


def test_schema_hints_shape_the_schema() -> None:
    from ci import chartdoc

    text = (
        "# -- A port.\n# @schema type=port\nport: 80\n"
        "# -- A choice.\n# @schema enum=[a, b]\nchoice: a\n"
        "# -- A pattern, raw.\n# @schema pattern=^\\S+$\n# @schema maxLength=8\nname: x\n"
        "# -- Kubernetes resources.\n# @schema $ref=core.v1.ResourceRequirements\n"
        "resources:\n  # -- Limits, documented though passed through.\n  limits: {}\n"
        "# -- Env.\n# @schema items.$ref=core.v1.EnvVar\nenv: []\n"
    )
    props = chartdoc.build_schema(text)["properties"]
    assert props["port"] == {"description": "A port.", "type": "integer", "minimum": 1, "maximum": 65535}
    assert props["choice"]["enum"] == ["a", "b"]
    assert props["name"]["pattern"] == r"^\S+$" and props["name"]["maxLength"] == 8
    assert props["resources"] == {
        "description": "Kubernetes resources.",
        "$ref": "#/definitions/io.k8s.api.core.v1.ResourceRequirements",
    }
    assert props["env"]["items"] == {"$ref": "#/definitions/io.k8s.api.core.v1.EnvVar"}


@pytest.mark.parametrize(
    "text,line,words",
    [
        ("# -- x\n# @schema minimun=0\nx: 1\n", 2, "unknown @schema keyword `minimun`"),
        ("# -- x\n# @schema items.minimun=0\nx: []\n", 2, "unknown @schema keyword `items.minimun`"),
        ("# -- x\n# @schema minimum=0\n\nx: 1\n", 2, "no value below it"),
        ("# -- x\nx: 1\n# @schema minimum=0\n", 3, "no value below it"),
        ("# -- x\n# @schema minimum=0\n# -- y\ny: 1\n", 2, "comment below it"),
        ("# -- x\n# @schema minimum=0\n# more words\nx: 1\n", 2, "comment below it"),
        ("# -- x\n# @schema minimum\nx: 1\n", 2, "malformed"),
        ("# -- x\n# @schema minimum=\nx: 1\n", 2, "malformed"),
        ("# -- x\n# @schemaminimum=0\nx: 1\n", 2, "malformed"),
        ("# -- x\n# @schema minimum=zero\nx: 1\n", 2, "`minimum` needs a"),
        ("# -- x\n# @schema enum=[a\nx: a\n", 2, "neither JSON nor a YAML flow value"),
        ("# -- x\n# @schema type=portt\nx: 1\n", 2, "unknown type"),
        ("# -- x\n# @schema $ref=core.v1.Nope\nx: {}\n", 2, "no Kubernetes definition `core.v1.Nope`"),
        ("# -- x\n# @schema pattern=([\nx: a\n", 2, "not a regular expression"),
        ("# -- x\n# @schema minimum=0\n# @schema minimum=1\nx: 1\n", 3, "given twice"),
        (
            "# -- r\n# @schema $ref=core.v1.ResourceRequirements\nr:\n  # -- l\n  # @schema minimum=1\n  limits: {}\n",
            5,
            "inside the pass-through `r`",
        ),
        ("# -- o\n# @schema minimum=1\no:\n  # -- a\n  a: 1\n", 2, "object of the chart's own keys"),
    ],
)
def test_bad_schema_hints_fail_naming_the_line(text: str, line: int, words: str) -> None:
    from ci import chartdoc

    with pytest.raises(chartdoc.ValuesError) as err:
        chartdoc.build_schema(text)
    assert f"values.yaml:{line}: " in str(err.value) and words in str(err.value), str(err.value)


def test_a_value_no_template_reads_is_reported() -> None:
    from ci import chartdoc

    schema = chartdoc.build_schema("# -- a\na: 1\n# -- b\nb:\n  # -- c\n  c: 2\n  # -- d\n  d: 3\n")
    assert chartdoc.unused_values(schema, "{{ .Values.a }} {{ .Values.b.c }}") == ["b.d"]
    assert chartdoc.unused_values(schema, '{{ get .Values.b "d" }} {{ .Values.a }} {{ .Values.b.c }}') == []


def test_comments_inside_pass_through_values_reach_the_readme() -> None:
    readme = (helm.CHART / "README.md").read_text()
    for role in ("prefill", "decode", "router"):
        assert f"| `{role}.resources.limits` | object |" in readme


# --- moved values (files/moved-values.yaml) ------------------------------------------------------


def test_moved_values_are_refused_naming_the_new_key(any_helm: Path) -> None:
    import yaml

    moved = yaml.safe_load((helm.CHART / "files" / "moved-values.yaml").read_text())
    readme = (helm.CHART / "README.md").read_text()
    values = yaml.safe_load((helm.CHART / "values.yaml").read_text())
    assert moved, "no moved values listed"
    for old, move in moved.items():
        new = move["to"].split(".")
        assert new[-1] in values[new[0]], (old, move)  # the new key exists
        assert f"`{old}`" in readme and f"`{move['to']}`" in readme, f"the README's Upgrading names {old}"
        result = helm.template(any_helm, values_yaml=f"{old}: {{}}\n")
        assert result.returncode != 0 and f"{old}: moved to {move['to']}" in result.stderr, result.stderr
