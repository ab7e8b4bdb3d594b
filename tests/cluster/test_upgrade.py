"""`helm upgrade` from the previous chart version to this one and `helm rollback`, against the real
API server; and the immutable-field guard (ci/upgrade_safety.py) checked against what the server
really refuses."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ci import lib
from ci import upgrade_safety as us
from tests import helm
from tests.cases import LMCACHE
from tests.cluster import fleet
from tests.cluster.controlplane import ControlPlane
from tests.cluster.releases import POD_SECURITY, by_component, names

ENVS = lib.environments()


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The chart, values and environment catalog of the previous chart version, from git."""
    rev = us.previous_version_rev()
    assert rev, "no earlier chart version in git history (a shallow clone?): fetch the history"
    root = tmp_path_factory.mktemp("previous")
    us.extract(rev, root)
    return rev, root


@pytest.fixture
def namespace(cluster: ControlPlane, request: pytest.FixtureRequest, helm_bin: Path) -> Iterator[str]:
    ns = f"up-{request.node.callspec.params.get('env', 'x')}-{names(helm_bin)}"
    cluster.create_namespace(fleet.namespace(ns, "privileged"))
    yield ns
    cluster.run(helm_bin, "uninstall", "pd", "-n", ns)  # no --wait: Helm 4.2.1 would sit out the timeout
    cluster.drop_namespace(ns)


def values(root: Path, env: str) -> list[str]:
    """`-f` flags of an environment's value files, from the catalog of the checkout at `root`."""
    return lib.value_flags(lib.environments(root)[env]["valueFiles"], root)


def helm_ok(cluster: ControlPlane, *args: str | Path) -> str:
    proc = cluster.run(*args)
    if proc.returncode != 0:
        ns = str(args[args.index("-n") + 1]) if "-n" in args else "default"
        raise AssertionError(proc.stdout + proc.stderr + cluster.diagnose(ns))
    return proc.stdout


def all_ready(cluster: ControlPlane, ns: str) -> bool:
    pods = cluster.get("pods", "-n", ns)["items"]
    return bool(pods) and all(
        p["status"].get("phase") == "Running"
        and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        for p in pods
        if "deletionTimestamp" not in p["metadata"]
    )


@pytest.mark.parametrize("env", sorted(ENVS))
def test_upgrade_from_the_previous_version_then_rollback(
    cluster: ControlPlane, helm_bin: Path, env: str, namespace: str, previous: tuple[str, Path]
) -> None:
    rev, old = previous
    assert POD_SECURITY[env] == "privileged"  # the namespace above enforces the widest level any needs
    helm_ok(
        cluster,
        helm_bin,
        "install",
        "pd",
        old / us.CHART,
        "-n",
        namespace,
        *values(old, env),
        "--wait",
        "--timeout",
        "300s",
    )
    helm_ok(
        cluster,
        helm_bin,
        "upgrade",
        "pd",
        helm.CHART,
        "-n",
        namespace,
        *values(helm.ROOT, env),
        "--wait",
        "--timeout",
        "300s",
    )
    history = yaml.safe_load(helm_ok(cluster, helm_bin, "history", "pd", "-n", namespace, "-o", "yaml"))
    assert [h["status"] for h in history] == ["superseded", "deployed"]
    assert history[-1]["chart"] == f"pd-inference-{us.chart_version((helm.CHART / 'Chart.yaml').read_text())}"
    cluster.wait_until("the upgraded pods Ready", lambda: all_ready(cluster, namespace))
    # The engines now start through the preflight (new in this version).
    engines = by_component(cluster.get("pods", "-n", namespace)["items"])
    assert all(p["spec"]["containers"][0]["command"][1] == "/etc/pd-inference/preflight.py" for p in engines["decode"])
    helm_ok(cluster, helm_bin, "rollback", "pd", "1", "-n", namespace, "--wait", "--timeout", "300s")
    history = yaml.safe_load(helm_ok(cluster, helm_bin, "history", "pd", "-n", namespace, "-o", "yaml"))
    assert history[-1]["status"] == "deployed" and history[-1]["description"].startswith("Rollback to 1")
    cluster.wait_until("the rolled-back pods Ready", lambda: all_ready(cluster, namespace))


@pytest.mark.parametrize("env", ["connector-switch"])
def test_switching_the_connector_both_ways_on_a_running_release(
    cluster: ControlPlane, helm_bin: Path, env: str, namespace: str
) -> None:
    """nixl -> lmcache turns the router's rollout to Recreate and back: both upgrades go through
    (the chart renders the strategy in full, never leaving the API server's defaults behind)."""
    lm = lib.value_flags([LMCACHE])
    for step, connector in enumerate(("nixl", "lmcache", "nixl")):
        verb = "install" if step == 0 else "upgrade"
        helm_ok(
            cluster,
            helm_bin,
            verb,
            "pd",
            helm.CHART,
            "-n",
            namespace,
            *lm,
            "--set",
            f"kvTransfer.connector={connector}",
            "--wait",
            "--timeout",
            "300s",
        )
        deploy = cluster.get("deployment", "pd-pd-inference-router", "-n", namespace)
        assert deploy["spec"]["strategy"]["type"] == ("Recreate" if connector == "lmcache" else "RollingUpdate")


# Changes to the chart, as a developer might make them: (templates file, pattern, replacement).
MUTATIONS: dict[str, tuple[str, str, str]] = {
    "statefulset serviceName": (
        "templates/engine/statefulset.yaml",
        r"serviceName: \{\{ \$name \}\}",
        "serviceName: {{ $name }}-v2",
    ),
    "statefulset podManagementPolicy": (
        "templates/engine/statefulset.yaml",
        "podManagementPolicy: Parallel",
        "podManagementPolicy: OrderedReady",
    ),
    "volumeClaimTemplates size": (
        "templates/engine/_pod.tpl",  # pd-inference.engine.modelCacheClaims
        r"storage: \{\{ \$pvc\.size \}\}",
        "storage: 301Gi",
    ),
    "every selector": (
        "templates/_helpers.tpl",
        r"app.kubernetes.io/component: \{\{ \.component \}\}\n",
        "app.kubernetes.io/component: {{ .component }}\napp.kubernetes.io/part-of: pd-inference\n",
    ),
    "pod template only (mutable)": (
        "templates/engine/statefulset.yaml",
        "revisionHistoryLimit: 5",
        "revisionHistoryLimit: 5\n  minReadySeconds: 5",
    ),
}


def mutated_chart(tmp: Path, file: str, pattern: str, replacement: str) -> Path:
    chart = tmp / "pd-inference"
    shutil.copytree(helm.CHART, chart)
    path = chart / file
    text, count = re.subn(pattern, replacement.replace("\\", "\\\\"), path.read_text(), count=1)
    assert count == 1, f"{pattern!r} not found in {file}"
    path.write_text(text)
    return chart


def render(chart: Path, env: str, ns: str) -> list[dict[str, Any]]:
    # With the CRDs' APIs (lib.capabilities()): the environments' monitors and rules need them.
    args = lib.helm_template(
        ENVS[env]["valueFiles"], helm=helm.helm_binaries()[0], chart=chart, namespace=ns, skip_tests=True
    )
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def refused_by_server(cluster: ControlPlane, docs: list[dict[str, Any]]) -> set[str]:
    """The workloads the API server refuses to update in place (dry run of each)."""
    out = set()
    for doc in docs:
        if doc["kind"] not in us.IMMUTABLE:
            continue
        proc = cluster.apply([doc], "--dry-run=server", "--force-conflicts", check=False)
        if proc.returncode != 0:
            assert "Forbidden" in proc.stderr or "field is immutable" in proc.stderr, proc.stderr
            out.add(f"{doc['kind']}/{doc['metadata']['name']}")
    return out


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_server_refuses_exactly_what_upgrade_safety_predicts(
    cluster: ControlPlane, tmp_path: Path, mutation: str, staging_release: Callable[[], str]
) -> None:
    ns = staging_release()
    chart = mutated_chart(tmp_path, *MUTATIONS[mutation])
    before, after = render(helm.CHART, "staging", ns), render(chart, "staging", ns)
    predicted = {c.split(": spec.")[0] for c in us.immutable_changes(before, after)}
    assert refused_by_server(cluster, after) == predicted
    assert bool(predicted) is (mutation != "pod template only (mutable)")
    # And what a user sees (with both Helms): `helm upgrade` fails with the server's refusal, or
    # goes through. Only for two of the changes: a failed upgrade leaves the release failed.
    if mutation in ("statefulset serviceName", "pod template only (mutable)"):
        for binary in helm.helm_binaries():
            proc = cluster.run(binary, "upgrade", "pd", chart, "-n", ns, *values(helm.ROOT, "staging"))
            if predicted:
                # 1.37 names the field ("spec.serviceName ... field is immutable"), 1.34 lists what may change.
                assert proc.returncode != 0 and (
                    "field is immutable" in proc.stderr or "are forbidden" in proc.stderr
                ), proc.stderr
            else:
                assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def staging_release(cluster: ControlPlane) -> Iterator[Callable[[], str]]:
    """staging (StatefulSets with volumeClaimTemplates) installed once for the mutation tests."""
    ns = f"immutable-{cluster.version.replace('.', '-')}"
    installed: list[str] = []

    def get() -> str:
        if not installed:
            cluster.create_namespace(fleet.namespace(ns, "privileged"))
            h3 = helm.helm_binaries()[1]
            helm_ok(
                cluster,
                h3,
                "install",
                "pd",
                helm.CHART,
                "-n",
                ns,
                *values(helm.ROOT, "staging"),
                "--wait",
                "--timeout",
                "300s",
            )
            installed.append(ns)
        return ns

    yield get
    if installed:
        cluster.run(helm.helm_binaries()[1], "uninstall", "pd", "-n", ns)
        cluster.drop_namespace(ns)
