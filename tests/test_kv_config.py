"""The KV hand-off config per role and connector: vLLM's --kv-transfer-config and LMCache's file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import helm
from tests.cases import LAYERINGS, LMCACHE, model_name, scenarios
from tests.engines.rendered import chart_says_lora

# `container` is unused here: tests/test_ports_and_policies.py still imports it (and lmcache_config)
# from this module, until it imports them from tests.manifests.
from tests.manifests import container, env, kv_transfer_config, lmcache_config  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
LMCACHE_KEYS = {
    line.strip()
    for line in (ROOT / "ci/data/lmcache-0.5.6-config-keys.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}
RETIRED_KEYS = {
    "enable_nixl",
    "nixl_role",
    "nixl_receiver_host",
    "nixl_receiver_port",
    "nixl_peer_host",
    "nixl_proxy_port",
}
NEVER_RENDERED = {"pd_skip_proxy_notification"}


def test_lmcache_kv_transfer_config_per_role(h4: Path) -> None:
    docs = helm.render(h4, (LMCACHE,))
    assert kv_transfer_config(docs, "prefill") == {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"discard_partial_chunks": False, "lmcache_rpc_port": "producer1"},
    }
    assert kv_transfer_config(docs, "decode") == {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {
            "discard_partial_chunks": False,
            "lmcache_rpc_port": "consumer1",
            "skip_last_n_tokens": 1,
        },
    }
    for role in ("prefill", "decode"):
        assert env(docs, role)["LMCACHE_CONFIG_FILE"] == "/etc/lmcache/lmcache.yaml"
        assert "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env(docs, role)


@pytest.mark.parametrize("efa,backend", [(False, "UCX"), (True, "LIBFABRIC")])
def test_nixl_kv_transfer_config(h4: Path, efa: bool, backend: str) -> None:
    docs = helm.render(h4, sets=("kvTransfer.connector=nixl", f"efa.enabled={str(efa).lower()}"))
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        assert kv_transfer_config(docs, role) == {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
            "kv_load_failure_policy": "fail",
            "kv_buffer_device": "cuda",
            "kv_connector_extra_config": {"backends": [backend]},
        }
        e = env(docs, role)
        assert e["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert e["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "$(POD_IP)"
        assert e["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
        assert "LMCACHE_CONFIG_FILE" not in e
    assert not helm.find(docs, "ConfigMap", "-lmcache")


def test_nixl_stages_kv_in_host_memory_when_asked(h4: Path) -> None:
    docs = helm.render(h4, sets=("kvTransfer.nixl.bufferDevice=cpu",))
    assert kv_transfer_config(docs, "prefill")["kv_buffer_device"] == "cpu"


@pytest.mark.parametrize(
    "files,sets,want",
    [
        ((), (), "DS"),  # the default model, Qwen3.5-9B, is hybrid (Gated DeltaNet)
        ((), ("model.name=/models/in-house-ssm",), "DS"),  # a hybrid the chart cannot recognise
        ((), ("model.name=meta-llama/Llama-3.1-8B-Instruct",), "DS"),  # harmless without Mamba layers
        ((LMCACHE,), (), None),  # LMCache serves only full-attention models
    ],
)
def test_every_nixl_engine_gets_the_conv_state_layout_hybrid_models_need(
    h4: Path, files: tuple[str, ...], sets: tuple[str, ...], want: str | None
) -> None:
    docs = helm.render(h4, files, sets)
    for role in ("prefill", "decode"):
        assert env(docs, role).get("VLLM_SSM_CONV_STATE_LAYOUT") == want


def test_pythonhashseed_zero_in_both_roles_and_connectors(h4: Path) -> None:
    for files in ((LMCACHE,), ()):
        docs = helm.render(h4, files)
        for role in ("prefill", "decode"):
            assert env(docs, role)["PYTHONHASHSEED"] == "0"


@pytest.mark.parametrize("efa,backend", [(False, "UCX"), (True, "LIBFABRIC")])
def test_lmcache_keys_per_role(h4: Path, efa: bool, backend: str) -> None:
    docs = helm.render(
        h4,
        (LMCACHE,),
        sets=(f"efa.enabled={str(efa).lower()}", "decode.tensorParallelSize=4", "prefill.tensorParallelSize=4"),
    )
    sender, receiver = lmcache_config(docs, "prefill"), lmcache_config(docs, "decode")
    common = {
        "enable_pd": True,
        "transfer_channel": "nixl",
        "nixl_backends": [backend],
        "local_cpu": False,
        "pd_buffer_size": 2147483648,
        "pd_buffer_device": "cuda",
        "chunk_size": 256,
        # LMCache 0.5.6 forces it for PD (and warns on every start) when it is not rendered.
        "save_unfull_chunk": True,
    }
    assert sender == {
        **common,
        "pd_role": "sender",
        "pd_proxy_host": f"pd-pd-inference-router.{helm.NAMESPACE}.svc.cluster.local",
        "pd_proxy_port": 7500,
    }
    assert receiver == {
        **common,
        "pd_role": "receiver",
        "pd_peer_host": "0.0.0.0",
        "pd_peer_init_port": [7300, 7301, 7302, 7303],
        "pd_peer_alloc_port": [7400, 7401, 7402, 7403],
    }


def test_lmcache_extra_config_is_passed_to_both_roles(h4: Path) -> None:
    docs = helm.render(h4, (LMCACHE,), sets=("kvTransfer.lmcache.extraConfig.pd_allocation_timeout_sec=60",))
    for role in ("prefill", "decode"):
        assert lmcache_config(docs, role)["pd_allocation_timeout_sec"] == 60


@pytest.mark.parametrize("name", LAYERINGS)
def test_no_retired_or_unknown_lmcache_key_anywhere(h4: Path, name: str) -> None:
    # Every layering, switched to LMCache. Those serving Qwen3.5 (hybrid) must be refused instead.
    # (LMCache's MP mode rides on NIXL: off, or the chart refuses the switch)
    sets = (
        "kvTransfer.connector=lmcache",
        "kvTransfer.nixl.lmcacheMp.enabled=false",
        "router.replicas=1",
        "router.autoscaling.enabled=false",
    )
    result = helm.template(h4, LAYERINGS[name], sets=sets)
    if "qwen3.5" in model_name(LAYERINGS[name]).lower():
        assert result.returncode != 0 and "kvTransfer.connector: lmcache cannot serve" in result.stderr
        return
    if helm.find(helm.render(h4, LAYERINGS[name]), "LeaderWorkerSet"):  # multi-node engines
        assert result.returncode != 0 and "lmcache serves one-node engines" in result.stderr
        return
    if chart_says_lora(LAYERINGS[name]):  # LoRA adapters (LMCache's key leaves them out)
        assert result.returncode != 0 and "lmcache cannot serve LoRA adapters" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    for key in RETIRED_KEYS | NEVER_RENDERED:
        assert key not in result.stdout
    for role in ("prefill", "decode"):
        config = lmcache_config(result.docs, role)
        assert set(config) <= LMCACHE_KEYS, set(config) - LMCACHE_KEYS
        assert config["enable_pd"] is True  # a real boolean: LMCache reads 'yes' as false


def test_kv_buffer_check_accepts_a_buffer_that_fits(h4: Path) -> None:
    # 8192 tokens x 327,680 B = 2,684,354,560 B: exactly enough passes.
    shape = (
        "model.maxModelLen=8192",
        "model.kvShape.layers=80",
        "model.kvShape.kvHeads=8",
        "model.kvShape.headDim=128",
    )
    ok = helm.template(h4, (LMCACHE,), sets=shape + ("kvTransfer.lmcache.bufferSize=2684354560",))
    assert ok.returncode == 0, ok.stderr
    short = helm.template(h4, (LMCACHE,), sets=shape + ("kvTransfer.lmcache.bufferSize=2684354559",))
    assert short.returncode != 0 and "kvTransfer.lmcache.bufferSize" in short.stderr


def test_kv_buffer_check_is_per_tensor_parallel_rank(h4: Path) -> None:
    # TP 8 over 8 KV heads: each rank holds one head, 2 x 80 x 1 x 128 x 2 x 8192 = 335,544,320 B.
    shape = (
        "model.maxModelLen=8192",
        "model.kvShape.layers=80",
        "model.kvShape.kvHeads=8",
        "model.kvShape.headDim=128",
    )
    tp8 = ("prefill.tensorParallelSize=8", "decode.tensorParallelSize=8")
    assert (
        helm.template(h4, (LMCACHE,), sets=shape + tp8 + ("kvTransfer.lmcache.bufferSize=335544320",)).returncode == 0
    )
    short = helm.template(h4, (LMCACHE,), sets=shape + tp8 + ("kvTransfer.lmcache.bufferSize=335544319",))
    assert short.returncode != 0 and "tensorParallelSize 8" in short.stderr


def test_sidecar_receiver_points_the_sender_at_localhost(h4: Path) -> None:
    docs = helm.render(h4, (LMCACHE,), sets=("kvTransfer.lmcache.notificationReceiver=prefillSidecar",))
    sender = lmcache_config(docs, "prefill")
    assert sender["pd_proxy_host"] == "127.0.0.1" and sender["pd_proxy_port"] == 7500
    assert lmcache_config(docs, "decode")["pd_role"] == "receiver"


HYBRID_NAMES = [
    "Qwen/Qwen3.5-9B",
    "Qwen/Qwen3.5-397B-A17B",
    "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "ai21labs/AI21-Jamba-Mini-1.7",
    "tiiuae/Falcon-H1-7B-Instruct",
    "ibm-granite/granite-4.0-h-small",
    "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
    "state-spaces/mamba-2.8b-hf",
    "/models/qwen3.5-9b",  # a local path says it too
    "Qwen/Qwen3.6-35B-A3B",
    "ibm-granite/granite-4.0-tiny-preview",
    "inclusionAI/Ling-3.0-flash",
    "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B",
    "openbmb/MiniCPM-V-4_6",
]
FULL_NAMES = [
    "meta-llama/Llama-3.3-70B-Instruct",
    "Qwen/Qwen3-32B",
    "mistralai/Mistral-Small-3.2-24B-Instruct-2506",
    "nvidia/nemotron-3-8b-base-4k",  # a 2023 full-attention model, not Nemotron 3
    "/models/mamba-team/llama-3-8b",  # only the last path segment names the model
    "google/gemma-3-27b-it",  # sliding-window + full attention: full for the chart
]


@pytest.mark.parametrize("name", HYBRID_NAMES)
def test_lmcache_refuses_a_hybrid_model_family_named_in_model_name(h4: Path, name: str) -> None:
    result = helm.template(h4, sets=("kvTransfer.connector=lmcache", f"model.name={name}"))
    assert result.returncode != 0
    assert "kvTransfer.connector" in result.stderr and "hybrid" in result.stderr, result.stderr
    # The same model on NixlConnector is what the chart proposes, and it renders.
    assert helm.template(h4, sets=(f"model.name={name}",)).returncode == 0


@pytest.mark.parametrize("name", FULL_NAMES)
def test_lmcache_serves_full_attention_models(h4: Path, name: str) -> None:
    result = helm.template(h4, sets=("kvTransfer.connector=lmcache", f"model.name={name}"))
    assert result.returncode == 0, result.stderr


def test_declared_attention_wins_over_the_name(h4: Path) -> None:
    declared_hybrid = ("kvTransfer.connector=lmcache", "model.name=/models/in-house", "model.attention=hybrid")
    result = helm.template(h4, sets=declared_hybrid)
    assert result.returncode != 0 and "model.attention is hybrid" in result.stderr
    # An operator who knows better can declare a hybrid-looking name full.
    declared_full = ("kvTransfer.connector=lmcache", "model.name=acme/mamba-distilled-llama", "model.attention=full")
    assert helm.template(h4, sets=declared_full).returncode == 0


LMCACHE_MP = scenarios()["scenario:lmcache-mp+dev"]  # LMCache's MP mode on a full-attention model


def test_lmcache_mp_rides_on_nixl_with_a_server_in_every_engine_pod(h4: Path) -> None:
    """kvTransfer.nixl.lmcacheMp: vLLM's MultiConnector, NixlConnector first (the hand-off, the
    router's NIXL route unchanged) and LMCacheMPConnector second, kv_both, at the pod's own
    server on 127.0.0.1; that server a container of the engine pod, engine-driven, with no GPU
    and no port any NetworkPolicy opens. Negative control: off, NixlConnector alone and no server."""
    docs = helm.render(h4, LMCACHE_MP)
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        kv = kv_transfer_config(docs, role)
        assert (kv["kv_connector"], kv["kv_role"], kv["kv_load_failure_policy"]) == ("MultiConnector", kv_role, "fail")
        nixl, lmc = kv["kv_connector_extra_config"]["connectors"]
        assert (nixl["kv_connector"], nixl["kv_role"]) == ("NixlConnector", kv_role)
        assert lmc == {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": 6555,
                "lmcache.mp.mp_transfer_mode": "engine_driven",
            },
        }
        pod = helm.one(docs, "StatefulSet", f"-{role}")["spec"]["template"]["spec"]
        (server,) = [c for c in pod["containers"] if c["name"] == "lmcache-server"]
        assert "--port=6555" in server["args"] and "--host=127.0.0.1" in server["args"]
        assert "--supported-transfer-mode=engine_driven" in server["args"] and "--l1-size-gb=40" in server["args"]
        assert server["resources"]["limits"]["memory"] == server["resources"]["requests"]["memory"] == "42Gi"
        assert "nvidia.com/gpu" not in str(server["resources"])
        assert server["securityContext"]["runAsNonRoot"] is True
        policy = helm.one(docs, "NetworkPolicy", f"-{role}")
        opened = {p.get("port") for rule in policy["spec"].get("ingress", []) for p in rule.get("ports", [])}
        assert not opened & {6555, 6556, "lmcache-http"}, opened
    off = helm.render(h4, LMCACHE_MP, ("kvTransfer.nixl.lmcacheMp.enabled=false",))
    assert kv_transfer_config(off, "decode")["kv_connector"] == "NixlConnector"
    assert all(
        c["name"] != "lmcache-server"
        for c in helm.one(off, "StatefulSet", "-decode")["spec"]["template"]["spec"]["containers"]
    )


@pytest.mark.parametrize(
    "sets,words",
    [
        (
            ("kvTransfer.connector=lmcache", "router.replicas=1", "router.autoscaling.enabled=false"),
            "rides on the NIXL hand-off",
        ),
        (("model.name=Qwen/Qwen3.5-9B", "model.attention="), "is a hybrid model"),
        (
            ("model.lora.adapters[0].name=a", "model.lora.adapters[0].rank=8", "model.lora.adapters[0].path=/models/a"),
            "leaves the LoRA adapter out",
        ),
        (("prefill.nodes=2",), "prefill.nodes is 2"),
    ],
    ids=["lmcache connector", "hybrid model", "lora", "multi-node"],
)
def test_lmcache_mp_is_refused_where_it_cannot_serve(h4: Path, sets: tuple[str, ...], words: str) -> None:
    result = helm.template(h4, LMCACHE_MP, sets)
    assert result.returncode != 0
    assert "kvTransfer.nixl.lmcacheMp.enabled: " in result.stderr and words in result.stderr, result.stderr
