"""The fake nodes of the test cluster, shaped like the profiles' instance types (kwok runs them),
and what the cluster needs besides the chart: the operators' CRDs, a `gp3` StorageClass with
volumes to bind (no CSI driver here), namespaces labelled for Pod Security.

Two availability zones, each with room for a whole environment, so "all engines in one zone" is
a choice the chart's placement makes, not the only one the scheduler has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ci import crd_schema

ZONES = ("us-east-1a", "us-east-1b")
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}  # as EKS GPU node groups


@dataclass(frozen=True)
class InstanceType:
    name: str
    capacity: dict[str, str]
    gpu: bool
    per_zone: int


# Capacities from EC2 (Karpenter's instance-type reference): p5.48xlarge 8 H100, 32 EFA; g6.8xlarge
# 1 L4, 1 EFA. Huge pages as the EKS EFA AMIs pre-allocate them.
FLEET = (
    InstanceType(
        "p5.48xlarge",
        {
            "cpu": "192",
            "memory": "2048Gi",
            "pods": "110",
            "nvidia.com/gpu": "8",
            "vpc.amazonaws.com/efa": "32",
            "hugepages-2Mi": "10Gi",
            "ephemeral-storage": "3500Gi",
        },
        gpu=True,
        per_zone=4,
    ),
    InstanceType(
        "g6.8xlarge",
        {
            "cpu": "32",
            "memory": "128Gi",
            "pods": "110",
            "nvidia.com/gpu": "1",
            "vpc.amazonaws.com/efa": "1",
            "hugepages-2Mi": "6Gi",
            "ephemeral-storage": "900Gi",
        },
        gpu=True,
        per_zone=3,
    ),
    InstanceType(
        "m7i.4xlarge",  # the CPU nodes the router and the helm test pod run on
        {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"},
        gpu=False,
        per_zone=2,
    ),
)


def nodes() -> list[dict[str, Any]]:
    out = []
    for zone in ZONES:
        for itype in FLEET:
            for i in range(itype.per_zone):
                name = f"{itype.name.replace('.', '-')}-{zone[-2:]}-{i}"
                out.append(
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "metadata": {
                            "name": name,
                            "annotations": {"kwok.x-k8s.io/node": "fake"},
                            "labels": {
                                "kubernetes.io/hostname": name,
                                "kubernetes.io/os": "linux",
                                "kubernetes.io/arch": "amd64",
                                "node.kubernetes.io/instance-type": itype.name,
                                "topology.kubernetes.io/zone": zone,
                                "topology.kubernetes.io/region": zone[:-1],
                            },
                        },
                        "spec": {"taints": [GPU_TAINT]} if itype.gpu else {},
                        "status": {"capacity": itype.capacity, "allocatable": itype.capacity},
                    }
                )
    return out


def crds() -> str:
    """Every CRD in ci/crds/ (Argo CD, Prometheus Operator, KEDA, Gateway API, LeaderWorkerSet), as
    one YAML stream."""
    return "\n---\n".join(p.read_text() for p in sorted(crd_schema.CRDS.glob("*/*.yaml")))


def storage(volumes: int = 16) -> list[dict[str, Any]]:
    """`gp3` as staging names it, statically provisioned: the PV controller binds the claims of the
    StatefulSets' volumeClaimTemplates to these volumes, as the EBS CSI driver would create them."""
    sc = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": "gp3"},
        "provisioner": "kubernetes.io/no-provisioner",
        "volumeBindingMode": "Immediate",
    }
    pvs = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"gp3-{i}"},
            "spec": {
                "capacity": {"storage": "1Ti"},
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": "gp3",
                "persistentVolumeReclaimPolicy": "Delete",
                "hostPath": {"path": f"/var/lib/fake-ebs/{i}"},
            },
        }
        for i in range(volumes)
    ]
    return [sc, *pvs]


def namespace(name: str, pod_security: str) -> dict[str, Any]:
    """A namespace enforcing a Pod Security level (and warning at restricted, for the record)."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "labels": {
                "pod-security.kubernetes.io/enforce": pod_security,
                "pod-security.kubernetes.io/warn": "restricted",
            },
        },
    }
