"""Validate custom resources against their CRDs (ci/crds/), as strictly as the API server does with
`--validate=strict` (server-side field validation): a field the CRD's structural schema does not
declare is an error, not something silently pruned.

The CRD's `openAPIV3Schema` is turned into a JSON Schema: every object schema with `properties`
and neither `additionalProperties` nor `x-kubernetes-preserve-unknown-fields` refuses other keys,
`x-kubernetes-int-or-string` becomes integer-or-string, and `metadata` is left to Kubernetes'
own rules. The cluster test tier (tests/cluster/) checks the same objects against a real API
server; this is the offline check `ci/render.py` runs in every CI.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "crds"


def strict(schema: Any) -> Any:
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return out
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


@functools.cache
def schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> strict JSON Schema, for every served version of every CRD in ci/crds/."""
    out = {}
    for path in sorted(CRDS.glob("*/*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if not version.get("served"):
                    continue
                schema = strict(version["schema"]["openAPIV3Schema"])
                schema.setdefault("properties", {})["metadata"] = {"type": "object"}
                out[(f"{group}/{version['name']}", kind)] = schema
    return out


def api_versions() -> list[str]:
    """`group/version/Kind` of every served custom kind in ci/crds/ (what `--api-versions` takes)."""
    return [f"{api}/{kind}" for api, kind in sorted(schemas())]


def is_custom_resource(doc: dict[str, Any]) -> bool:
    """Not a built-in kind: one of ci/crds/ (the Gateway API's group is a *.k8s.io one, served by
    CRDs all the same), or an API group with a dot that is not one of Kubernetes' *.k8s.io groups."""
    if (doc.get("apiVersion"), doc.get("kind")) in schemas():
        return True
    group = str(doc.get("apiVersion", "")).rpartition("/")[0]
    return "." in group and not group.endswith(".k8s.io")


def validate(doc: dict[str, Any]) -> list[str]:
    """Errors of a custom resource against its CRD (empty = valid); an unknown kind is an error."""
    schema = schemas().get((doc.get("apiVersion"), doc.get("kind")))
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    if schema is None:
        return [f"{name}: no CRD for {doc.get('apiVersion')} {doc.get('kind')} in ci/crds/"]
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{name}: /{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]
