"""Bad values fail `helm template` with a message that names the field, with both Helm versions.
Schema errors name the JSON pointer (`/prefill/replicas`); template rules name the dotted key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import helm
from tests.cases import LMCACHE, REFUSED_ALONE

# (values file content, strings the error must contain), layered over the chart defaults
# (NixlConnector, the hybrid Qwen3.5-9B).
BAD_VALUES: dict[str, tuple[str, tuple[str, ...]]] = {
    "typo_top_level": ("routr:\n  replicas: 2\n", ("routr",)),
    "typo_nested": ("prefill:\n  tensorParalelSize: 2\n", ("/prefill", "tensorParalelSize")),
    "wrong_type_replicas": ("decode:\n  replicas: two\n", ("/decode/replicas",)),
    "negative_replicas": ("prefill:\n  replicas: -1\n", ("/prefill/replicas",)),
    "bad_connector_enum": ("kvTransfer:\n  connector: mooncake\n", ("/kvTransfer/connector",)),
    "bad_backend_enum": ("kvTransfer:\n  backend: TCP\n", ("/kvTransfer/backend",)),
    "port_out_of_range": ("ports:\n  engineHttp: 70000\n", ("/ports/engineHttp",)),
    "zero_tensor_parallel": ("decode:\n  tensorParallelSize: 0\n", ("/decode/tensorParallelSize",)),
    "gpu_utilisation_above_one": ("prefill:\n  gpuMemoryUtilization: 1.5\n", ("/prefill/gpuMemoryUtilization",)),
    "retired_lmcache_key": (
        "kvTransfer:\n  lmcache:\n    extraConfig:\n      enable_nixl: true\n",
        ("/kvTransfer/lmcache/extraConfig", "enable_nixl"),
    ),
    "chart_owned_lmcache_key": (
        "kvTransfer:\n  lmcache:\n    extraConfig:\n      pd_skip_proxy_notification: true\n",
        ("/kvTransfer/lmcache/extraConfig", "pd_skip_proxy_notification"),
    ),
    "bad_toleration_type": (
        "prefill:\n  tolerations:\n    - key: 1\n      operator: Sometimes\n",
        ("/prefill/tolerations/0",),
    ),
    "bad_env_entry": ("engine:\n  env:\n    - value: x\n", ("/engine/env/0", "name")),
    "bad_quantity": ("efa:\n  hugepages2Mi: lots\n", ("/efa/hugepages2Mi",)),
    "bad_image_digest": ("engineImage:\n  digest: md5:abc\n", ("/engineImage/digest",)),
    "bad_model_cache_type": ("modelCache:\n  type: s3\n", ("/modelCache/type",)),
    "partial_kv_shape": ("model:\n  kvShape: {layers: 80}\n", ("model.kvShape.kvHeads",)),
    "pinned_zone_vs_node_selector": (
        "placement:\n  zone: us-east-1a\ndecode:\n  nodeSelector:\n    topology.kubernetes.io/zone: us-east-1b\n",
        ("decode.nodeSelector", "placement.zone"),
    ),
    "pinned_zone_vs_affinity": (
        "placement:\n  zone: us-east-1a\nprefill:\n  affinity:\n    nodeAffinity:\n"
        "      requiredDuringSchedulingIgnoredDuringExecution:\n        nodeSelectorTerms:\n"
        "          - matchExpressions:\n              - {key: topology.kubernetes.io/zone, operator: In, values: [us-east-1c]}\n",
        ("prefill.affinity", "placement.zone"),
    ),
    "efa_across_zones": ("efa:\n  enabled: true\nplacement:\n  sameZone: false\n", ("placement.sameZone",)),
    "gpu_in_resources": (
        "prefill:\n  resources:\n    limits:\n      nvidia.com/gpu: 4\n",
        ("prefill.resources.limits.nvidia.com/gpu",),
    ),
    "hpa_without_metrics": ("decode:\n  autoscaling:\n    enabled: true\n", ("decode.autoscaling.metrics",)),
    "autoscaling_min_above_max": (
        "prefill:\n  autoscaling: {enabled: true, kind: keda, minReplicas: 5, maxReplicas: 2, kedaTriggers: [{type: cpu, metadata: {}}]}\n",
        ("prefill.autoscaling.minReplicas",),
    ),
    "port_collision": ("ports:\n  nixlSideChannel: 8000\n", ("ports.nixlSideChannel", "ports.engineHttp")),
    "lmcache_port_ranges_overlap": (
        "ports:\n  lmcacheAllocBase: 7301\ndecode:\n  tensorParallelSize: 2\nprefill:\n  tensorParallelSize: 2\n",
        ("ports.lmcacheAllocBase",),
    ),
    "threshold_not_below_max_len": ("router:\n  threshold: 5000\nmodel:\n  maxModelLen: 4096\n", ("router.threshold",)),
    "protect_metrics_without_keys": ("router:\n  auth:\n    protectMetrics: true\n", ("router.auth.protectMetrics",)),
    # Prometheus would get 401 on every scrape of a protected router.
    "protected_metrics_scraped_without_a_token": (
        "router:\n  auth:\n    existingSecret: keys\n    protectMetrics: true\nmetrics:\n  serviceMonitor:\n    enabled: true\n",
        ("router.auth.metricsTokenSecret.name", "metrics.serviceMonitor.enabled"),
    ),
    "metrics_token_without_protected_metrics": (
        "router:\n  auth:\n    metricsTokenSecret:\n      name: tok\n",
        ("router.auth.metricsTokenSecret.name", "router.auth.protectMetrics"),
    ),
    "keda_queue_trigger_without_prometheus": (
        "decode:\n  autoscaling:\n    enabled: true\n    kind: keda\n    targetWaitingPerReplica: 8\n"
        "metrics:\n  podMonitor:\n    enabled: true\n",
        ("metrics.prometheusUrl",),
    ),
    "queue_autoscaling_without_the_podmonitor": (
        "decode:\n  autoscaling:\n    enabled: true\n    targetWaitingPerReplica: 8\n",
        ("metrics.podMonitor.enabled", "decode.autoscaling.targetWaitingPerReplica"),
    ),
    "hpa_without_a_signal": (
        "prefill:\n  autoscaling:\n    enabled: true\n",
        ("prefill.autoscaling.targetWaitingPerReplica",),
    ),
    "alerts_without_the_engine_monitor": (
        "metrics:\n  serviceMonitor: {enabled: true}\n  prometheusRule: {enabled: true}\n",
        ("metrics.prometheusRule.enabled", "metrics.podMonitor.enabled"),
    ),
    "alert_labels_overriding_severity": (
        "metrics:\n  serviceMonitor: {enabled: true}\n  podMonitor: {enabled: true}\n"
        "  prometheusRule:\n    enabled: true\n    alertLabels: {severity: page}\n",
        ("metrics.prometheusRule.alertLabels.severity",),
    ),
    "metrics_token_key_with_a_slash": (
        "router:\n  auth:\n    metricsTokenSecret:\n      key: a/b\n",
        ("/router/auth/metricsTokenSecret/key",),
    ),
    "alert_threshold_above_one": (
        "metrics:\n  prometheusRule:\n    thresholds:\n      fallbackShare: 1.5\n",
        ("/metrics/prometheusRule/thresholds/fallbackShare",),
    ),
    "bad_notification_receiver": (
        "kvTransfer:\n  lmcache:\n    notificationReceiver: decoder\n",
        ("/kvTransfer/lmcache/notificationReceiver",),
    ),
    "bad_kv_load_failure_policy": (
        "kvTransfer:\n  connector: nixl\n  nixl:\n    loadFailurePolicy: ignore\n",
        ("/kvTransfer/nixl/loadFailurePolicy",),
    ),
    "router_tokenizer_from_file_and_hub": (
        "model:\n  routerTokenizer: /models/tokenizer.json\n  routerTokenizerFromHub: true\n",
        ("model.routerTokenizerFromHub", "model.routerTokenizer"),
    ),
    "router_tokenizer_from_hub_of_a_path": (
        "model:\n  name: /models/qwen\n  routerTokenizerFromHub: true\n",
        ("model.routerTokenizerFromHub", "/models/qwen"),
    ),
    "model_revision_with_space": ("model:\n  revision: main branch\n", ("/model/revision",)),
    "hub_endpoint_not_a_url": ("model:\n  hubEndpoint: hub.internal\n", ("/model/hubEndpoint",)),
    # The chart default model is hybrid: LMCache's connector cannot serve it in the checked vLLM.
    "lmcache_with_the_default_hybrid_model": (
        "kvTransfer:\n  connector: lmcache\n",
        ("kvTransfer.connector", "Qwen/Qwen3.5-9B", "hybrid", "nixl"),
    ),
    "lmcache_with_a_declared_hybrid_model": (
        "kvTransfer:\n  connector: lmcache\nmodel:\n  name: /models/in-house-ssm\n  attention: hybrid\n",
        ("kvTransfer.connector", "model.attention is hybrid"),
    ),
    "bad_attention_enum": ("model:\n  attention: linear\n", ("/model/attention",)),
    "bad_nixl_buffer_device": ("kvTransfer:\n  nixl:\n    bufferDevice: gpu\n", ("/kvTransfer/nixl/bufferDevice",)),
    "preflight_python_with_space": ("engine:\n  preflight:\n    python: python3 -u\n", ("/engine/preflight/python",)),
    # Placement the chart can know cannot work (templates/_helpers.tpl pd-inference.instanceTypes).
    "tp_above_the_instance_types_gpus": (
        "prefill:\n  instanceType: g6.8xlarge\n  tensorParallelSize: 4\ndecode:\n  tensorParallelSize: 4\n",
        ("prefill.tensorParallelSize", "g6.8xlarge has 1"),
    ),
    "efa_devices_above_the_instance_types": (
        "efa:\n  enabled: true\n  devices: 32\ndecode:\n  instanceType: p5en.48xlarge\n  tensorParallelSize: 8\n"
        "prefill:\n  tensorParallelSize: 8\n",
        ("efa.devices", "p5en.48xlarge has 16"),
    ),
    "efa_on_an_instance_type_without_efa": (
        "efa:\n  enabled: true\n  devices: 1\nprefill:\n  instanceType: g6.2xlarge\n",
        ("efa.enabled", "g6.2xlarge has no EFA"),
    ),
}

# The same, layered over tests/scenarios/lmcache.yaml (LMCache PD with a full-attention model): the
# rules that hold only for the LMCache connector.
BAD_LMCACHE_VALUES: dict[str, tuple[str, tuple[str, ...]]] = {
    "undersized_kv_buffer": (
        "model:\n  maxModelLen: 8192\n  kvShape: {layers: 80, kvHeads: 8, headDim: 128, bytesPerElement: 2}\n"
        "kvTransfer:\n  lmcache:\n    bufferSize: 1073741824\n",
        ("kvTransfer.lmcache.bufferSize", "2684354560"),
    ),
    "two_routers_with_lmcache": ("router:\n  replicas: 2\n", ("router.replicas", "prefillSidecar")),
    "router_hpa_with_lmcache": ("router:\n  autoscaling:\n    enabled: true\n", ("router.autoscaling.enabled",)),
    "unequal_tp_with_lmcache": (
        "prefill:\n  tensorParallelSize: 2\ndecode:\n  tensorParallelSize: 4\n",
        ("decode.tensorParallelSize",),
    ),
    "sidecar_port_collides_with_engine": (
        "kvTransfer:\n  lmcache:\n    notificationReceiver: prefillSidecar\nports:\n  notificationSidecar: 8000\n",
        ("ports.notificationSidecar", "ports.engineHttp"),
    ),
    "chart_owned_save_unfull_chunk": (
        "kvTransfer:\n  lmcache:\n    extraConfig:\n      save_unfull_chunk: false\n",
        ("/kvTransfer/lmcache/extraConfig", "save_unfull_chunk"),
    ),
}


def test_there_are_at_least_fifteen_cases() -> None:
    assert len(BAD_VALUES) + len(BAD_LMCACHE_VALUES) >= 15


CASES = {**{k: ((), *v) for k, v in BAD_VALUES.items()}, **{k: ((LMCACHE,), *v) for k, v in BAD_LMCACHE_VALUES.items()}}


@pytest.mark.parametrize("case", CASES)
def test_bad_values_fail_naming_the_field(any_helm: Path, case: str) -> None:
    base, content, expected = CASES[case]
    result = helm.template(any_helm, base, values_yaml=content)
    assert result.returncode != 0, f"{case} rendered:\n{result.stdout[:500]}"
    for text in expected:
        assert text in result.stderr, f"{case}: {text!r} not in:\n{result.stderr}"
    # A clear message, not a Go panic or a template traceback.
    assert "panic" not in result.stderr and "goroutine" not in result.stderr


@pytest.mark.parametrize("case", ["two_routers_with_lmcache", "router_hpa_with_lmcache", "unequal_tp_with_lmcache"])
def test_lmcache_only_rules_do_not_fire_on_nixl(h4: Path, case: str) -> None:
    """The negative control of the LMCache-only rules: on the NIXL defaults these values render."""
    content, _ = BAD_LMCACHE_VALUES[case]
    result = helm.template(h4, values_yaml=content)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("path", REFUSED_ALONE)
def test_an_environment_that_needs_its_profile_is_refused_alone(h4: Path, path: str) -> None:
    result = helm.template(h4, (path,))
    assert result.returncode != 0 and REFUSED_ALONE[path] in result.stderr, result.stderr
