"""Generated and committed artefacts are current."""

from __future__ import annotations

import difflib
import subprocess
import sys

from tests import helm, snapshot


def test_default_render_matches_snapshot() -> None:
    expected, actual = snapshot.SNAPSHOT.read_text(), snapshot.current()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True), "snapshot", "render", n=1))
    assert not diff, f"default render changed; review and run `make snapshot`:\n{diff[:4000]}"


def test_schema_and_readme_are_generated_from_values_yaml() -> None:
    proc = subprocess.run(
        [sys.executable, "ci/chartdoc.py", "--check"], cwd=helm.ROOT, capture_output=True, text=True, timeout=60
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
