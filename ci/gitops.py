"""What Argo CD does with argocd/, reproduced offline, so CI and the tests check what a cluster would get.

1. `kustomize build argocd/` (the bootstrap Application syncs argocd/ with kustomize): the subset used
   there, i.e. `resources` plus `replacements` (source kind/name/fieldPath; targets by kind/name with
   dotted field paths, numeric indexes and `*`), dropping `config.kubernetes.io/local-config` objects.
2. The ApplicationSet controller: the git files generator over this repository's files, Go templates
   with `missingkey=error` on every string field of `template`, then `templatePatch` rendered and
   applied as a strategic merge patch (Argo CD's Application types carry no list merge keys, so
   maps merge and lists are replaced).
3. The repo server: the `helm template` command line for an Application's Helm source with its
   `$values` value files, release name, namespace, parameters and `skipTests`.

Anything outside that subset fails loudly ("unsupported ...") rather than rendering something
Argo CD would not. `kubectl kustomize argocd/` gives the same as step 1 (tests compare when kubectl
is installed).

    python -m ci.gitops apps               # the Applications the ApplicationSet generates (YAML)
    python -m ci.gitops command ENV        # the helm template command Argo CD runs for ENV (one word a line)
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from ci import lib

ROOT = lib.ROOT
ARGOCD = ROOT / "argocd"
LOCAL_CONFIG = "config.kubernetes.io/local-config"


class GitOpsError(Exception):
    pass


# --- 1. kustomize (the subset argocd/kustomization.yaml uses) -----------------------------------


def kustomize_build(directory: Path = ARGOCD) -> list[dict[str, Any]]:
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kust) - {"apiVersion", "kind", "resources", "replacements"}
    if unsupported:
        raise GitOpsError(f"kustomization.yaml: unsupported keys for ci/gitops.py: {sorted(unsupported)}")
    docs: list[dict[str, Any]] = []
    for res in kust.get("resources", []):
        docs += [d for d in yaml.safe_load_all((directory / res).read_text()) if d]
    for rep in kust.get("replacements", []):
        src = rep["source"]
        (source_doc,) = [d for d in docs if _selected(d, src)] or [None]
        if source_doc is None:
            raise GitOpsError(f"replacement source not found: {src}")
        value = _get(source_doc, src["fieldPath"])
        for target in rep["targets"]:
            matched = [d for d in docs if _selected(d, target["select"])]
            if not matched:
                raise GitOpsError(f"replacement target matches nothing: {target['select']}")
            for doc in matched:
                for path in target["fieldPaths"]:
                    _set(doc, path.split("."), value)
    return [d for d in docs if d.get("metadata", {}).get("annotations", {}).get(LOCAL_CONFIG) != "true"]


def _selected(doc: dict[str, Any], sel: dict[str, Any]) -> bool:
    unsupported = set(sel) - {"kind", "name", "fieldPath"}
    if unsupported:
        raise GitOpsError(f"unsupported selector keys {sorted(unsupported)}")
    return doc.get("kind") == sel.get("kind", doc.get("kind")) and doc["metadata"]["name"] == sel.get(
        "name", doc["metadata"]["name"]
    )


def _get(doc: Any, path: str) -> Any:
    for part in path.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def _set(node: Any, parts: list[str], value: Any) -> None:
    head, rest = parts[0], parts[1:]
    if isinstance(node, list):
        indexes = range(len(node)) if head == "*" else [int(head)]
        for i in indexes:
            if rest:
                _set(node[i], rest, value)
            else:
                node[i] = value
        return
    if head not in node:
        raise GitOpsError(f"replacement target field {head!r} does not exist (kustomize would not create it)")
    if rest:
        _set(node[head], rest, value)
    else:
        node[head] = value


# --- 2. Go templates (the subset the ApplicationSet uses) ----------------------------------------

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def go_template(text: str, params: dict[str, Any]) -> str:
    """text/template with missingkey=error, for: `.a.b`, `.`, string literals, `printf`, pipes
    into `quote`/`toJson`/`normalize`, `if`/`else`/`end`, `range`/`end`."""
    tokens: list[tuple[str, str]] = []  # ("text", s) | ("action", s)
    pos = 0
    for m in _ACTION.finditer(text):
        before = text[pos : m.start()]
        if m.group(1):
            before = before.rstrip(" \t\r\n")
        if tokens and tokens[-1][0] == "trim-next":
            tokens.pop()
            before = before.lstrip(" \t\r\n")
        tokens.append(("text", before))
        tokens.append(("action", m.group(2)))
        if m.group(3):
            tokens.append(("trim-next", ""))
        pos = m.end()
    tail = text[pos:]
    if tokens and tokens[-1][0] == "trim-next":
        tokens.pop()
        tail = tail.lstrip(" \t\r\n")
    tokens.append(("text", tail))
    tree, rest = _parse(tokens, 0, ())
    if rest != len(tokens):
        raise GitOpsError(f"unexpected {{{{ {tokens[rest][1]} }}}}")
    return _exec(tree, params)


def _parse(tokens: list[tuple[str, str]], i: int, stop: tuple[str, ...]) -> tuple[list[Any], int]:
    nodes: list[Any] = []
    while i < len(tokens):
        kind, body = tokens[i]
        if kind == "text":
            nodes.append(("text", body))
            i += 1
            continue
        word = body.split(" ", 1)[0]
        if word in stop:
            return nodes, i
        if word in ("if", "range"):
            inner, i = _parse(tokens, i + 1, ("else", "end"))
            other: list[Any] = []
            if tokens[i][1] == "else":
                other, i = _parse(tokens, i + 1, ("end",))
            if tokens[i][1] != "end":
                raise GitOpsError(f"{word} without end")
            nodes.append((word, body.split(" ", 1)[1], inner, other))
            i += 1
            continue
        if word in ("else", "end", "with", "define", "template", "block") or body.startswith(("$", "/*")):
            raise GitOpsError(f"unsupported template action {{{{ {body} }}}} (extend ci/gitops.py or simplify)")
        nodes.append(("expr", body))
        i += 1
    if stop:
        raise GitOpsError(f"missing {{{{ end }}}} (expected one of {stop})")
    return nodes, i


def _exec(nodes: list[Any], dot: Any) -> str:
    out = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "expr":
            out.append(_to_text(_pipeline(node[1], dot)))
        elif node[0] == "if":
            out.append(_exec(node[2] if _truthy(_pipeline(node[1], dot)) else node[3], dot))
        elif node[0] == "range":
            items = _pipeline(node[1], dot)
            if not isinstance(items, list):
                raise GitOpsError(f"range over non-list {node[1]!r}")
            out.append("".join(_exec(node[2], item) for item in items) if items else _exec(node[3], dot))
    return "".join(out)


def _pipeline(expr: str, dot: Any) -> Any:
    stages = [s.strip() for s in expr.split("|")]
    value = _command(stages[0], dot, None)
    for stage in stages[1:]:
        value = _command(stage, dot, value)
    return value


def _command(cmd: str, dot: Any, piped: Any) -> Any:
    args = re.findall(r'"(?:[^"\\]|\\.)*"|\S+', cmd)
    name, rest = args[0], [_operand(a, dot) for a in args[1:]]
    if piped is not None:
        rest.append(piped)
    if name == "quote":
        return json.dumps(_to_text(rest[-1]))
    if name == "toJson":
        return json.dumps(rest[-1], separators=(",", ":"))
    if name == "normalize":
        return re.sub(r"[^a-z0-9.-]", "-", _to_text(rest[-1]).lower())[:253]
    if name == "printf":
        return rest[0] % tuple(_to_text(a) for a in rest[1:])
    if rest or piped is not None:
        raise GitOpsError(f"unsupported template function {name!r}")
    return _operand(name, dot)


def _operand(token: str, dot: Any) -> Any:
    if token.startswith('"'):
        return json.loads(token)
    if token == ".":
        return dot
    if token.startswith("."):
        value = dot
        for key in token[1:].split("."):
            if not isinstance(value, dict) or key not in value:
                raise GitOpsError(f"map has no entry for key {key!r} in {token} (missingkey=error)")
            value = value[key]
        return value
    raise GitOpsError(f"unsupported template operand {token!r}")


def _truthy(v: Any) -> bool:
    return bool(v)


def _to_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        raise GitOpsError(f"cannot print a {type(v).__name__} into a template string: {v!r}")
    return str(v)


# --- 2b. the ApplicationSet controller ------------------------------------------------------------


def _git_files_params(gen: dict[str, Any], root: Path) -> list[dict[str, Any]]:
    unsupported = set(gen) - {"repoURL", "revision", "files", "values"}
    if unsupported:
        raise GitOpsError(f"git generator: unsupported keys {sorted(unsupported)}")
    params = []
    for spec in gen["files"]:
        for path in sorted(root.glob(spec["path"])):
            rel = path.relative_to(root)
            content = yaml.safe_load(path.read_text())
            p: dict[str, Any] = dict(content)
            p["path"] = {
                "path": str(rel.parent),
                "segments": list(rel.parent.parts),
                "basename": rel.parent.name,
                "basenameNormalized": re.sub(r"[^a-z0-9.-]", "-", rel.parent.name.lower()),
                "filename": rel.name,
                "filenameNormalized": re.sub(r"[^a-z0-9.-]", "-", rel.name.lower()),
            }
            # Generator values are templates themselves, rendered with the file's params.
            p["values"] = {k: go_template(str(v), p) for k, v in (gen.get("values") or {}).items()}
            params.append(p)
    return params


def _render_fields(node: Any, params: dict[str, Any]) -> Any:
    if isinstance(node, str):
        return go_template(node, params)
    if isinstance(node, dict):
        return {k: _render_fields(v, params) for k, v in node.items()}
    if isinstance(node, list):
        return [_render_fields(v, params) for v in node]
    return node


def _prune_empty(node: Any) -> Any:
    """Go's json `omitempty`: empty lists/maps/strings vanish when the controller re-marshals."""
    if isinstance(node, dict):
        pruned = {k: _prune_empty(v) for k, v in node.items()}
        return {k: v for k, v in pruned.items() if v not in ([], {}, "", None)}
    if isinstance(node, list):
        return [_prune_empty(v) for v in node]
    return node


def generate_applications(appset: dict[str, Any], root: Path = ROOT) -> list[dict[str, Any]]:
    spec = appset["spec"]
    if not spec.get("goTemplate") or "missingkey=error" not in spec.get("goTemplateOptions", []):
        raise GitOpsError("ApplicationSet must use goTemplate with missingkey=error")
    apps = []
    for gen in spec["generators"]:
        if set(gen) != {"git"}:
            raise GitOpsError(f"unsupported generator {sorted(gen)} (ci/gitops.py reproduces git files only)")
        for params in _git_files_params(gen["git"], root):
            tmpl = _render_fields(copy.deepcopy(spec["template"]), params)
            app = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Application", **tmpl}
            app["metadata"].setdefault("namespace", appset["metadata"]["namespace"])
            if spec.get("templatePatch"):
                patch = yaml.safe_load(go_template(spec["templatePatch"], params))
                app = lib.deep_merge(app, patch)
            apps.append(_prune_empty(app))
    return apps


def applications(root: Path = ROOT) -> list[dict[str, Any]]:
    """Every Application Argo CD ends up with: the generated ones and the bootstrap one."""
    docs = kustomize_build(root / "argocd")
    apps = [d for d in docs if d["kind"] == "Application"]
    for appset in (d for d in docs if d["kind"] == "ApplicationSet"):
        apps += generate_applications(appset, root)
    return apps


def environment_applications(root: Path = ROOT) -> dict[str, dict[str, Any]]:
    """Generated Applications by environment name (pd-<env> -> <env>): exactly one per entry of
    the environment catalog (ci/lib.py environments())."""
    catalog = lib.environments(root)
    docs = kustomize_build(root / "argocd")
    out = {}
    for appset in (d for d in docs if d["kind"] == "ApplicationSet"):
        for app in generate_applications(appset, root):
            out[app["metadata"]["labels"]["pd-inference/environment"]] = app
    if sorted(out) != sorted(catalog):
        raise GitOpsError(
            f"the ApplicationSet generates Applications for {sorted(out)}, the catalog ({lib.CATALOG}/) has {sorted(catalog)}"
        )
    return dict(sorted(out.items()))


def environment_application(env: str, root: Path = ROOT) -> dict[str, Any]:
    """The Application of one environment; an unknown name is an error that lists the catalog."""
    lib.environment(env, root)
    return environment_applications(root)[env]


# --- 3. the repo server's helm template command ---------------------------------------------------


def helm_command(app: dict[str, Any], helm: Path | str | None = None, root: Path = ROOT) -> list[str]:
    """The `helm template` command line the repo server runs for an Application's Helm source, with
    paths resolved in this checkout and the cluster capabilities CI assumes (lib.capabilities()).
    The `$ref` sources must point at this same repository and revision."""
    spec = app["spec"]
    sources = spec.get("sources") or [spec["source"]]
    refs = {s["ref"]: s for s in sources if s.get("ref")}
    charts = [s for s in sources if s.get("path")]
    if len(charts) != 1:
        raise GitOpsError(f"{app['metadata']['name']}: expected one chart source, found {len(charts)}")
    chart = charts[0]
    source = chart.get("helm", {})
    for name, ref in refs.items():
        if (ref["repoURL"], ref["targetRevision"]) != (chart["repoURL"], chart["targetRevision"]):
            raise GitOpsError(f"${name} points at another repository or revision than the chart")
    files = []
    for vf in source.get("valueFiles", []):
        m = re.fullmatch(r"\$(\w+)/(.+)", vf)
        if m:
            if m.group(1) not in refs:
                raise GitOpsError(f"value file {vf}: no source with ref {m.group(1)!r}")
            path = root / m.group(2)
        else:
            path = root / chart["path"] / vf
        if not path.is_file():
            raise GitOpsError(f"{app['metadata']['name']}: value file {vf} does not exist ({path})")
        files.append(path)
    for unsupported in ("values", "valuesObject", "fileParameters", "apiVersions", "kubeVersion"):
        if unsupported in source:
            raise GitOpsError(f"helm.{unsupported} is not reproduced by ci/gitops.py")
    # Helm applies every --set before every --set-string, whatever their order on the line.
    params = source.get("parameters", [])
    return lib.helm_template(
        files,
        sets=[f"{p['name']}={p['value']}" for p in params if not p.get("forceString")],
        set_strings=[f"{p['name']}={p['value']}" for p in params if p.get("forceString")],
        helm=helm,
        release=source.get("releaseName", app["metadata"]["name"]),
        chart=root / chart["path"],
        namespace=source.get("namespace") or spec["destination"]["namespace"],
        root=root,
        include_crds=True,
        skip_tests=bool(source.get("skipTests")),
        skip_crds=bool(source.get("skipCrds")),
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["apps"]:
        yaml.safe_dump_all(applications(), sys.stdout, sort_keys=False)
        return 0
    if len(argv) == 2 and argv[0] == "command":
        try:
            app = environment_application(argv[1])
        except lib.CatalogError as exc:
            print(exc, file=sys.stderr)
            return 2
        print("\n".join(helm_command(app)))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
