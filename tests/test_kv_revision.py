"""The KV-compatibility revision (templates/engine/_revision.tpl): one per release, on both roles'
command lines as a second served name and on their pods as a label, in the form the router reads
(pd_router.revision); it changes with what makes one engine's KV usable by another, and with
nothing an engine does not read."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pd_router import revision

from tests import helm
from tests.cases import LAYERINGS

PROD = LAYERINGS["env:prod"]
LABEL = "pd-inference.io/kv-revision"


def engines(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {role: helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"] for role in ("prefill", "decode")}


def revisions(h4: Path, sets: tuple[str, ...] = (), files: tuple[str, ...] = PROD) -> set[str]:
    """Every revision the render names, in args and labels (one, if all is well)."""
    out = set()
    for pod in engines(helm.render(h4, files, sets)).values():
        out.add(pod["metadata"]["labels"][LABEL])
        (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
        args = c["args"]
        i = args.index("--served-model-name")
        served, kv_name = args[i + 1], args[i + 2]
        listing = {"object": "list", "data": [{"id": served}, {"id": kv_name}]}
        out.add(revision.from_models(listing, served))  # what the router reads from /v1/models
    return out


def one_revision(h4: Path, sets: tuple[str, ...] = ()) -> str:
    """The one revision of the chart's defaults with ``sets`` (prod pins an image digest, which
    wins over the tag)."""
    (rev,) = revisions(h4, sets, files=())
    assert re.fullmatch(r"[0-9a-f]{10}", rev), rev
    return rev


@pytest.mark.parametrize("env", sorted(k for k in LAYERINGS if k.startswith("env:")))
def test_both_roles_name_one_revision_the_router_can_read(h4: Path, env: str) -> None:
    (rev,) = revisions(h4, files=LAYERINGS[env])
    assert rev and rev != revision.NONE


def test_the_engines_answer_with_the_plain_name_first(h4: Path) -> None:
    for pod in engines(helm.render(h4, PROD)).values():
        (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "vllm"]
        i = c["args"].index("--served-model-name")
        assert c["args"][i + 1] == "qwen3.5-9b" or not c["args"][i + 1].count(revision.SEPARATOR)
        assert c["args"][i + 2] == revision.alias(c["args"][i + 1], pod["metadata"]["labels"][LABEL])


KV_CHANGES = {
    "model revision": ("model.revision=0123456789abcdef0123456789abcdef01234567",),
    "model name": ("model.name=Qwen/Qwen3-8B",),
    "engine image tag": ("engine.image.tag=v9.9.9",),
    "engine image digest": ("engine.image.digest=sha256:" + "a" * 64,),
    "connector": ("kvTransfer.connector=lmcache", "model.name=meta-llama/Llama-3.1-8B-Instruct"),
    "nixl backend": ("kvTransfer.backend=LIBFABRIC",),
    "kv cache dtype, one argument": ("prefill.extraArgs[0]=--kv-cache-dtype=fp8",),
    "kv cache dtype, two arguments": ("decode.extraArgs[0]=--kv-cache-dtype", "decode.extraArgs[1]=fp8"),
    "block size": ("decode.extraArgs[0]=--block-size=32",),
    "dtype": ("prefill.extraArgs[0]=--dtype=float16",),
    "quantization": ("decode.extraArgs[0]=--quantization=fp8",),
}
NO_KV_CHANGES = {
    "router threshold": ("router.threshold=1024",),
    "router replicas": ("router.replicas=5",),
    "chart-only engine knobs": ("prefill.podAnnotations.team=ml", "decode.replicas=4"),
    "an alert threshold": ("metrics.prometheusRule.thresholds.fallbackShare=1",),
    "decode tensor parallel size": ("decode.tensorParallelSize=2",),
    "prefill replicas": ("prefill.replicas=3",),
    "a scheduler flag": ("prefill.extraArgs[0]=--max-num-seqs=64",),
    # KV-cache events only report what the cache holds (engine.kvEvents)
    "kv events off": ("engine.kvEvents.enabled=false",),
    "kv event ports": ("ports.kvEvents=6557", "ports.kvEventsReplay=6558"),
}


@pytest.mark.parametrize("name", sorted(KV_CHANGES))
def test_the_revision_changes_with_what_the_kv_depends_on(h4: Path, name: str) -> None:
    assert one_revision(h4, KV_CHANGES[name]) != one_revision(h4)


@pytest.mark.parametrize("name", sorted(NO_KV_CHANGES))
def test_the_revision_stays_for_what_the_kv_does_not_depend_on(h4: Path, name: str) -> None:
    assert one_revision(h4, NO_KV_CHANGES[name]) == one_revision(h4)


def test_the_flag_forms_name_the_same_revision(h4: Path) -> None:
    joined = one_revision(h4, ("decode.extraArgs[0]=--kv-cache-dtype=fp8",))
    split = one_revision(h4, ("decode.extraArgs[0]=--kv-cache-dtype", "decode.extraArgs[1]=fp8"))
    assert joined == split
