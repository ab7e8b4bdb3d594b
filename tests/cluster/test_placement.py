"""Placement the chart cannot judge (no instance type pinned): the scheduler keeps the pod
Pending and says why. Where the chart can judge, `helm template` refuses it naming the field
(tests/test_bad_values.py: tensorParallelSize or efa.devices above the instance type's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import helm
from tests.cluster import fleet
from tests.cluster.controlplane import ControlPlane

CASES = {
    "more GPUs than any node has": (
        ("prefill.tensorParallelSize=16", "decode.tensorParallelSize=16"),
        "Insufficient nvidia.com/gpu",
    ),
    "more EFA devices than any node has": (
        ("efa.enabled=true", "efa.devices=64"),
        "Insufficient vpc.amazonaws.com/efa",
    ),
}


@pytest.fixture
def ns(cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    name = "pending-" + "-".join(request.node.callspec.params["case"].split()[:3]).lower()
    cluster.create_namespace(fleet.namespace(name, "privileged"))
    yield name
    cluster.run(helm.helm_binaries()[1], "uninstall", "pd", "-n", name)
    cluster.drop_namespace(name)


@pytest.mark.parametrize("case", CASES)
def test_the_scheduler_says_why_it_cannot_place_an_engine(cluster: ControlPlane, ns: str, case: str) -> None:
    sets, reason = CASES[case]
    args = [a for s in sets for a in ("--set", s)]
    proc = cluster.run(helm.helm_binaries()[1], "install", "pd", helm.CHART, "-n", ns, *args)
    assert proc.returncode == 0, proc.stderr  # the chart cannot know: instanceType is not pinned

    def failed_scheduling() -> str:
        events = cluster.get("events", "-n", ns, "--field-selector", "reason=FailedScheduling")["items"]
        return next((e["message"] for e in events if e["involvedObject"]["name"].endswith("-prefill-0")), "")

    message = cluster.wait_until("the scheduler's FailedScheduling event", failed_scheduling)
    assert reason in message, message
    pod = cluster.get("pod", "pd-pd-inference-prefill-0", "-n", ns)
    assert pod["status"]["phase"] == "Pending" and "nodeName" not in pod["spec"]
