"""Bad values fail `helm template` with a message that names the field, with both Helm versions.
Schema errors name the JSON pointer (`/prefill/replicas`); template rules name the dotted key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import helm
from tests.cases import LMCACHE

# (values file content, strings the error must contain), layered over the chart defaults
# (NixlConnector, the hybrid Qwen3.5-9B).
BAD_VALUES: dict[str, tuple[str, tuple[str, ...]]] = {
    "typo_top_level": ("routr:\n  replicas: 2\n", ("routr",)),
    "ejection_cap_below_its_base": (
        "router:\n  health:\n    ejectionSeconds: 60\n    maxEjectionSeconds: 30\n",
        ("router.health.maxEjectionSeconds",),
    ),
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
    "bad_image_digest": ("engine:\n  image:\n    digest: md5:abc\n", ("/engine/image/digest",)),
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
    # --- issue 11: the classes an outside attack got through (each refused naming the field) ---
    "decode_tp_above_the_instance_types_gpus": (
        "decode:\n  instanceType: g6.8xlarge\n  tensorParallelSize: 2\n",
        ("decode.tensorParallelSize", "g6.8xlarge has 1"),
    ),
    "prefill_tp_not_sharding_the_kv_heads": (
        "model:\n  kvShape: {layers: 32, kvHeads: 8, headDim: 128, bytesPerElement: 2}\nprefill:\n  tensorParallelSize: 3\n",
        ("prefill.tensorParallelSize", "model.kvShape.kvHeads (8)"),
    ),
    "decode_tp_not_sharding_the_kv_heads": (
        "model:\n  kvShape: {layers: 32, kvHeads: 8, headDim: 128, bytesPerElement: 2}\ndecode:\n  tensorParallelSize: 6\n",
        ("decode.tensorParallelSize", "model.kvShape.kvHeads (8)"),
    ),
    # --- issue 26: multi-node engines (templates/engine/_multinode.tpl) ---
    "nodes_above_the_schemas_limit": ("decode:\n  nodes: 17\n", ("/decode/nodes",)),
    "nodes_that_cannot_share_the_gpus": ("decode:\n  nodes: 2\n", ("decode.nodes", "cannot share the engine's 1 GPUs")),
    "data_parallel_ranks_not_split_over_the_nodes": (
        "engine:\n  kvEvents:\n    enabled: false\ndecode:\n  nodes: 2\n  tensorParallelSize: 2\n  dataParallelSize: 3\n",
        ("decode.dataParallelSize", "do not split evenly over decode.nodes (2)"),
    ),
    "group_topology_for_a_one_node_engine": (
        "prefill:\n  groupTopologyKey: topology.k8s.aws/network-node-layer-3\n",
        ("prefill.groupTopologyKey", "prefill.nodes is 1"),
    ),
    "group_topology_key_not_a_label_key": (
        "prefill:\n  nodes: 2\n  tensorParallelSize: 2\n  groupTopologyKey: not a key\n",
        ("/prefill/groupTopologyKey",),
    ),
    "kv_events_with_data_parallel_ranks": (
        "decode:\n  dataParallelSize: 2\n",
        ("engine.kvEvents.enabled", "decode.dataParallelSize 2"),
    ),
    "multi_node_pods_above_the_instance_types_gpus": (
        "prefill:\n  instanceType: g6.12xlarge\n  nodes: 2\n  tensorParallelSize: 16\n",
        ("prefill.nodes", "8 GPUs per pod", "g6.12xlarge has 4"),
    ),
    "extra_args_repeat_nnodes": ("decode:\n  extraArgs: ['--nnodes=2']\n", ("decode.extraArgs", "decode.nodes")),
    "extra_args_repeat_headless": ("prefill:\n  extraArgs: ['--headless']\n", ("prefill.extraArgs", "prefill.nodes")),
    "extra_args_repeat_dp_short_form": (
        "decode:\n  extraArgs: ['-dp', '2']\n",
        ("decode.extraArgs", "decode.dataParallelSize"),
    ),
    "extra_args_repeat_tensor_parallel_size": (
        "prefill:\n  extraArgs: ['--tensor-parallel-size=2']\n",
        ("prefill.extraArgs", "prefill.tensorParallelSize"),
    ),
    "extra_args_repeat_tp_short_form": (
        "decode:\n  extraArgs: ['-tp', '2']\n",
        ("decode.extraArgs", "decode.tensorParallelSize"),
    ),
    "extra_args_repeat_kv_transfer_config": (
        "decode:\n  extraArgs: ['--kv-transfer-config', '{}']\n",
        ("decode.extraArgs", "kvTransfer"),
    ),
    "extra_args_repeat_max_model_len_with_underscores": (
        "prefill:\n  extraArgs: ['--max_model_len=1024']\n",
        ("prefill.extraArgs", "model.maxModelLen"),
    ),
    "extra_args_repeat_port": ("decode:\n  extraArgs: ['--port', '9000']\n", ("decode.extraArgs", "ports.engineHttp")),
    "extra_args_repeat_served_model_name": (
        "prefill:\n  extraArgs: ['--served-model-name=other']\n",
        ("prefill.extraArgs", "model.servedName"),
    ),
    "extra_args_repeat_gpu_memory_utilization": (
        "decode:\n  extraArgs: ['--gpu-memory-utilization', '0.5']\n",
        ("decode.extraArgs", "decode.gpuMemoryUtilization"),
    ),
    "extra_args_repeat_model": (
        "prefill:\n  extraArgs: ['--model', 'other/model']\n",
        ("prefill.extraArgs", "model.name"),
    ),
    "engine_env_overrides_pythonhashseed": (
        "engine:\n  env: [{name: PYTHONHASHSEED, value: '1'}]\n",
        ("engine.env", "PYTHONHASHSEED"),
    ),
    "decode_env_overrides_the_nixl_side_channel": (
        "decode:\n  env: [{name: VLLM_NIXL_SIDE_CHANNEL_PORT, value: '6000'}]\n",
        ("decode.env", "VLLM_NIXL_SIDE_CHANNEL_PORT"),
    ),
    "prefill_env_overrides_the_conv_state_layout": (
        "prefill:\n  env: [{name: VLLM_SSM_CONV_STATE_LAYOUT, value: SD}]\n",
        ("prefill.env", "VLLM_SSM_CONV_STATE_LAYOUT"),
    ),
    "engine_env_overrides_fi_provider_with_efa": (
        "efa:\n  enabled: true\n  devices: 1\nengine:\n  env: [{name: FI_PROVIDER, value: tcp}]\n",
        ("engine.env", "FI_PROVIDER"),
    ),
    "router_env_overrides_the_threshold": (
        "router:\n  env: [{name: PD_ROUTER__ROUTING__THRESHOLD, value: '0'}]\n",
        ("router.env", "PD_ROUTER__ROUTING__THRESHOLD"),
    ),
    "router_env_override_in_lower_case": (
        "router:\n  env: [{name: pd_router__limits__maxinflight, value: '1'}]\n",
        ("router.env", "pd_router__limits__maxinflight"),
    ),
    "ucx_over_efa": (
        "efa:\n  enabled: true\n  devices: 1\nkvTransfer:\n  backend: UCX\n",
        ("kvTransfer.backend", "UCX"),
    ),
    "region_selector_contradicts_the_zone": (
        "placement:\n  zone: us-east-1a\nprefill:\n  nodeSelector: {topology.kubernetes.io/region: us-west-2}\n",
        ("prefill.nodeSelector", "placement.zone=us-east-1a"),
    ),
    "engine_image_repository_not_a_reference": (
        "engine:\n  image:\n    repository: Not A Repo\n",
        ("/engine/image/repository",),
    ),
    "router_image_tag_with_a_colon": ("router:\n  image:\n    tag: 'v1:2'\n", ("/router/image/tag",)),
    "hf_token_secret_name_not_dns": ("model:\n  hfTokenSecret:\n    name: HF_Token\n", ("/model/hfTokenSecret/name",)),
    "hf_token_secret_key_with_a_slash": (
        "model:\n  hfTokenSecret:\n    name: hf\n    key: a/b\n",
        ("/model/hfTokenSecret/key",),
    ),
    "api_keys_secret_name_not_dns": (
        "router:\n  auth:\n    existingSecret: 'Keys!'\n",
        ("/router/auth/existingSecret",),
    ),
    "image_pull_secret_not_dns": ("imagePullSecrets: ['My Secret']\n", ("/imagePullSecrets/0",)),
    "cpu_request_not_a_quantity": (
        "prefill:\n  resources:\n    requests: {cpu: '4 cores', memory: 32Gi}\n    limits: {memory: 64Gi}\n",
        ("requests", "cpu"),
    ),
    "memory_request_above_its_limit": (
        "decode:\n  resources:\n    requests: {cpu: '4', memory: 128Gi}\n    limits: {memory: 64Gi}\n",
        ("decode.resources.requests.memory", "128Gi", "64Gi"),
    ),
    "router_cpu_request_above_its_limit": (
        "router:\n  resources:\n    requests: {cpu: '2'}\n    limits: {cpu: 500m}\n",
        ("router.resources.requests.cpu",),
    ),
    "label_key_with_a_space": ("commonLabels: {'bad key': x}\n", ("commonLabels", "bad key")),
    "pod_label_value_with_a_space": ("prefill:\n  podLabels: {team: 'a b'}\n", ("/prefill/podLabels",)),
    "label_value_over_63_characters": ("commonLabels: {team: " + "x" * 64 + "}\n", ("/commonLabels",)),
    "pod_label_overrides_the_selector": (
        "decode:\n  podLabels: {app.kubernetes.io/component: prefill}\n",
        ("decode.podLabels.app.kubernetes.io/component",),
    ),
    "common_label_the_chart_sets": (
        "commonLabels: {app.kubernetes.io/part-of: other}\n",
        ("commonLabels.app.kubernetes.io/part-of",),
    ),
    "router_pod_label_the_chart_sets": (
        "router:\n  podLabels: {helm.sh/chart: other}\n",
        ("router.podLabels.helm.sh/chart",),
    ),
    "fullname_override_too_long_for_a_statefulset": ("fullnameOverride: " + "a" * 45 + "\n", ("/fullnameOverride",)),
    "fullname_override_not_dns": ("fullnameOverride: My_Release\n", ("/fullnameOverride",)),
    "name_override_too_long": ("nameOverride: " + "n" * 45 + "\n", ("/nameOverride",)),
    "pdb_over_100_percent": ("prefill:\n  pdb:\n    maxUnavailable: 150%\n", ("/prefill/pdb/maxUnavailable",)),
    "no_decoder": ("decode:\n  replicas: 0\n", ("/decode/replicas",)),
    "pod_annotation_key_with_a_space": (
        "decode:\n  podAnnotations: {'bad key': x}\n",
        ("decode.podAnnotations", "bad key"),
    ),
    "node_selector_value_with_a_space": ("decode:\n  nodeSelector: {team: 'a b'}\n", ("/decode/nodeSelector",)),
    "grafana_namespace_not_dns": (
        "metrics:\n  grafanaDashboard:\n    enabled: true\n    namespace: Monitoring\n",
        ("/metrics/grafanaDashboard/namespace",),
    ),
    "prometheus_url_without_a_scheme": ("metrics:\n  prometheusUrl: prometheus:9090\n", ("/metrics/prometheusUrl",)),
    "alert_label_not_a_prometheus_label": (
        "metrics:\n  prometheusRule:\n    alertLabels: {team-name: x}\n",
        ("metrics.prometheusRule.alertLabels", "team-name"),
    ),
    "negative_queue_target": (
        "decode:\n  autoscaling:\n    targetWaitingPerReplica: -1\n",
        ("/decode/autoscaling/targetWaitingPerReplica",),
    ),
    "monitor_interval_with_a_space": (
        "metrics:\n  podMonitor:\n    interval: 30 s\n",
        ("/metrics/podMonitor/interval",),
    ),
    # the router's own start-up rules (pd_router.config, mirrored by ci/chartdoc.py)
    "session_affinity_header_not_a_header_name": (
        "router:\n  sessionAffinityHeader: X Session\n",
        ("/router/sessionAffinityHeader",),
    ),
    "body_limit_below_the_routers_minimum": (
        "router:\n  limits:\n    maxBodyBytes: 100\n",
        ("/router/limits/maxBodyBytes",),
    ),
    "header_limit_below_the_routers_minimum": (
        "router:\n  limits:\n    maxHeaders: 8\n",
        ("/router/limits/maxHeaders",),
    ),
    "egress_hub_peer_not_a_peer": (
        "networkPolicy:\n  egress:\n    hubTo: [{ipBlok: {cidr: 10.0.0.0/8}}]\n",
        ("/networkPolicy/egress/hubTo/0",),
    ),
    "metrics_proxy_port_is_the_side_channel": (
        "ports:\n  engineMetrics: 5600\n",
        ("ports.engineMetrics", "ports.nixlSideChannel"),
    ),
    "decode_efa_on_an_instance_type_without_efa": (
        "efa:\n  enabled: true\n  devices: 1\ndecode:\n  instanceType: g6.2xlarge\n",
        ("efa.enabled", "g6.2xlarge has no EFA"),
    ),
    # --- issue 22: bad values that passed `helm template` and failed at apply, at pod start or never ---
    # a. quantities: every resources block (the schema's Kubernetes Quantity carries the pattern)
    "sidecar_memory_limit_not_a_quantity": (
        "kvTransfer:\n  lmcache:\n    sidecar:\n      resources:\n        limits: {memory: 256 megs}\n",
        ("/kvTransfer/lmcache/sidecar/resources/limits/memory",),
    ),
    "metrics_proxy_cpu_request_not_a_quantity": (
        "engine:\n  metricsProxy:\n    resources:\n      requests: {cpu: one}\n",
        ("/engine/metricsProxy/resources/requests/cpu",),
    ),
    "router_memory_limit_not_a_quantity": (
        "router:\n  resources:\n    limits: {memory: 1GB}\n",
        ("/router/resources/limits/memory",),
    ),
    "extra_volume_size_limit_not_a_quantity": (
        "engine:\n  extraVolumes: [{name: scratch, emptyDir: {sizeLimit: 10 GiB}}]\n",
        ("/engine/extraVolumes/0/emptyDir/sizeLimit",),
    ),
    # the shared quantity pattern took `ki` (Kubernetes: Ki) and refused 512Ki
    "quantity_with_a_lower_case_binary_suffix": ("efa:\n  hugepages2Mi: 5120ki\n", ("/efa/hugepages2Mi",)),
    "sidecar_memory_request_above_its_limit": (
        "kvTransfer:\n  lmcache:\n    sidecar:\n      resources:\n"
        "        requests: {memory: 1Gi}\n        limits: {memory: 256Mi}\n",
        ("kvTransfer.lmcache.sidecar.resources.requests.memory", "1Gi", "256Mi"),
    ),
    "metrics_proxy_memory_request_above_its_limit": (
        "engine:\n  metricsProxy:\n    resources:\n      requests: {memory: 128Mi}\n      limits: {memory: 64Mi}\n",
        ("engine.metricsProxy.resources.requests.memory",),
    ),
    # b. values that become label values (node selectors)
    "zone_not_a_label_value": ("placement:\n  zone: us east 1a\n", ("/placement/zone",)),
    "zone_over_63_characters": ("placement:\n  zone: " + "z" * 64 + "\n", ("/placement/zone",)),
    "prefill_instance_type_not_a_label_value": ("prefill:\n  instanceType: p5.48xlarge/\n", ("/prefill/instanceType",)),
    "decode_instance_type_not_a_label_value": ("decode:\n  instanceType: 'p5 48xlarge'\n", ("/decode/instanceType",)),
    # c. root where every container says runAsNonRoot: true
    "engine_run_as_root_with_run_as_non_root": (
        "engine:\n  podSecurityContext: {runAsUser: 0, runAsNonRoot: true}\n",
        ("engine.podSecurityContext.runAsUser", "runAsNonRoot"),
    ),
    "router_run_as_root_with_run_as_non_root": (
        "router:\n  podSecurityContext: {runAsUser: 0}\n",
        ("router.podSecurityContext.runAsUser", "runAsNonRoot"),
    ),
    # the pod's runAsNonRoot: false does not help: every container sets it true
    "router_run_as_root_with_the_pods_run_as_non_root_off": (
        "router:\n  podSecurityContext: {runAsUser: 0, runAsNonRoot: false}\n",
        ("router.podSecurityContext.runAsUser", "every container"),
    ),
    # d. a check's timeout longer than its interval
    "router_health_timeout_longer_than_its_interval": (
        "router:\n  health: {intervalSeconds: 5, timeoutSeconds: 10}\n",
        ("router.health.timeoutSeconds", "router.health.intervalSeconds (5)"),
    ),
    "readiness_probe_timeout_longer_than_its_period": (
        "engine:\n  probes:\n    readiness: {periodSeconds: 10, timeoutSeconds: 30}\n",
        ("engine.probes.readiness.timeoutSeconds", "engine.probes.readiness.periodSeconds (10)"),
    ),
    "liveness_probe_timeout_longer_than_its_period": (
        "engine:\n  probes:\n    liveness: {periodSeconds: 5}\n",
        ("engine.probes.liveness.timeoutSeconds", "engine.probes.liveness.periodSeconds (5)"),
    ),
    "startup_probe_timeout_longer_than_its_period": (
        "engine:\n  probes:\n    startup: {periodSeconds: 2, timeoutSeconds: 5, failureThreshold: 900}\n",
        ("engine.probes.startup.timeoutSeconds",),
    ),
    "preflight_deadline_past_the_startup_window": (
        "engine:\n  preflight: {timeoutSeconds: 600}\n  probes:\n    startup: {periodSeconds: 10, failureThreshold: 30}\n",
        ("engine.preflight.timeoutSeconds", "300 s"),
    ),
    # e. the legacy zone and region labels, in node selectors and required node affinity
    "pinned_zone_vs_legacy_node_selector": (
        "placement:\n  zone: us-east-1a\ndecode:\n  nodeSelector:\n    failure-domain.beta.kubernetes.io/zone: us-east-1b\n",
        ("decode.nodeSelector", "failure-domain.beta.kubernetes.io/zone=us-east-1b", "placement.zone"),
    ),
    "pinned_zone_vs_legacy_affinity": (
        "placement:\n  zone: us-east-1a\nprefill:\n  affinity:\n    nodeAffinity:\n"
        "      requiredDuringSchedulingIgnoredDuringExecution:\n        nodeSelectorTerms:\n"
        "          - matchExpressions:\n"
        "              - {key: failure-domain.beta.kubernetes.io/zone, operator: In, values: [us-east-1c]}\n",
        ("prefill.affinity", "failure-domain.beta.kubernetes.io/zone", "placement.zone"),
    ),
    "pinned_zone_vs_legacy_affinity_not_in": (
        "placement:\n  zone: us-east-1a\ndecode:\n  affinity:\n    nodeAffinity:\n"
        "      requiredDuringSchedulingIgnoredDuringExecution:\n        nodeSelectorTerms:\n"
        "          - matchExpressions:\n"
        "              - {key: failure-domain.beta.kubernetes.io/zone, operator: NotIn, values: [us-east-1a]}\n",
        ("decode.affinity", "NotIn", "placement.zone"),
    ),
    "legacy_region_selector_contradicts_the_zone": (
        "placement:\n  zone: us-east-1a\nprefill:\n  nodeSelector: {failure-domain.beta.kubernetes.io/region: eu-west-1}\n",
        ("prefill.nodeSelector", "failure-domain.beta.kubernetes.io/region=eu-west-1", "placement.zone=us-east-1a"),
    ),
    "region_affinity_contradicts_the_zone": (
        "placement:\n  zone: us-east-1a\ndecode:\n  affinity:\n    nodeAffinity:\n"
        "      requiredDuringSchedulingIgnoredDuringExecution:\n        nodeSelectorTerms:\n"
        "          - matchExpressions:\n"
        "              - {key: topology.kubernetes.io/region, operator: In, values: [us-west-2]}\n",
        ("decode.affinity", "topology.kubernetes.io/region", "placement.zone"),
    ),
    "zone_affinity_does_not_exist_with_a_pinned_zone": (
        "placement:\n  zone: us-east-1a\nprefill:\n  affinity:\n    nodeAffinity:\n"
        "      requiredDuringSchedulingIgnoredDuringExecution:\n        nodeSelectorTerms:\n"
        "          - matchExpressions:\n              - {key: topology.kubernetes.io/zone, operator: DoesNotExist}\n",
        ("prefill.affinity", "DoesNotExist", "placement.zone"),
    ),
    # class names, checked as Kubernetes checks them (DNS-1123 subdomains of at most 253; a
    # scheduler name it does not check, nor does the chart: tests/test_operator_knobs.py)
    "priority_class_not_a_dns_subdomain": (
        "prefill:\n  priorityClassName: GPU_High\n",
        ("/prefill/priorityClassName",),
    ),
    "runtime_class_with_an_empty_label": ("decode:\n  runtimeClassName: nvidia..cdi\n", ("/decode/runtimeClassName",)),
    "router_priority_class_too_long": (f"router:\n  priorityClassName: {'a' * 254}\n", ("/router/priorityClassName",)),
    "engine_grace_period_shorter_than_the_drain": (
        "prefill:\n  drainSeconds: 200\n  terminationGracePeriodSeconds: 120\n",
        ("prefill.terminationGracePeriodSeconds", "prefill.drainSeconds (200 s)"),
    ),
    "engine_grace_period_moved_per_role": (
        "engine:\n  terminationGracePeriodSeconds: 60\n",
        ("/engine", "terminationGracePeriodSeconds"),
    ),
    "negative_dns_cache_seconds": ("engine:\n  drain:\n    dnsCacheSeconds: -1\n", ("/engine/drain/dnsCacheSeconds",)),
    "decode_drain_negative": ("decode:\n  drainSeconds: -5\n", ("/decode/drainSeconds",)),
    "router_anti_affinity_not_an_enum": ("router:\n  antiAffinity: always\n", ("/router/antiAffinity",)),
    "pvc_retention_not_retain_or_delete": (
        "modelCache:\n  pvc:\n    retentionPolicy:\n      whenScaled: Keep\n",
        ("/modelCache/pvc/retentionPolicy/whenScaled",),
    ),
    "hpa_behavior_unknown_field": (
        "router:\n  autoscaling:\n    behavior:\n      scaleDown: {window: 60}\n",
        ("/router/autoscaling/behavior/scaleDown", "window"),
    ),
    "hpa_behavior_window_not_a_number": (
        "decode:\n  autoscaling:\n    behavior:\n      scaleUp: {stabilizationWindowSeconds: soon}\n",
        ("/decode/autoscaling/behavior/scaleUp/stabilizationWindowSeconds",),
    ),
    "keda_polling_interval_zero": (
        "decode:\n  autoscaling:\n    keda:\n      pollingInterval: 0\n",
        ("/decode/autoscaling/keda/pollingInterval",),
    ),
    "keda_cooldown_negative": (
        "prefill:\n  autoscaling:\n    keda:\n      cooldownPeriod: -1\n",
        ("/prefill/autoscaling/keda/cooldownPeriod",),
    ),
    "keda_fallback_behavior_not_an_enum": (
        "decode:\n  autoscaling:\n    keda:\n      fallback: {replicas: 2, behavior: scalingModifiers}\n",
        ("/decode/autoscaling/keda/fallback/behavior",),
    ),
    # the HPA would clamp it to maxReplicas: what runs would not be what the values say
    "keda_fallback_above_max_replicas": (
        "metrics:\n  prometheusUrl: http://prometheus:9090\n  podMonitor: {enabled: true}\n"
        "decode:\n  autoscaling: {enabled: true, kind: keda, minReplicas: 2, maxReplicas: 4, targetWaitingPerReplica: 8,"
        " keda: {fallback: {replicas: 6}}}\n",
        ("decode.autoscaling.keda.fallback.replicas", "2..4"),
    ),
    "keda_fallback_on_an_hpa": (
        "prefill:\n  autoscaling: {enabled: true, kind: hpa, metrics: [{type: Resource, resource: {name: cpu,"
        " target: {type: Utilization, averageUtilization: 80}}}], keda: {fallback: {replicas: 1}}}\n",
        ("prefill.autoscaling.keda.fallback.replicas", "kind: keda"),
    ),
    # KEDA v2.20.2 CheckFallbackValid: no fallback on cpu/memory triggers alone
    "keda_fallback_with_only_a_cpu_trigger": (
        "decode:\n  autoscaling: {enabled: true, kind: keda, kedaTriggers: [{type: cpu, metricType: Utilization,"
        " metadata: {value: '80'}}], keda: {fallback: {replicas: 1}}}\n",
        ("decode.autoscaling.keda.fallback.replicas", "neither cpu nor memory"),
    ),
    # tracing and the Gateway API (issue 25)
    "tracing_grpc_endpoint_with_a_path": (
        "tracing:\n  endpoint: http://collector:4317/v1/traces\n",
        ("tracing.endpoint", "gRPC"),
    ),
    "tracing_grpc_over_tls_to_the_engines": (
        "tracing:\n  endpoint: https://collector:4317\n",
        ("tracing.endpoint", "plaintext", "http/protobuf"),
    ),
    "tracing_endpoint_not_a_url": ("tracing:\n  endpoint: collector:4317\n", ("/tracing/endpoint",)),
    "tracing_ratio_above_one": (
        "tracing:\n  endpoint: http://c:4317\n  samplingRatio: 2\n",
        ("/tracing/samplingRatio",),
    ),
    "tracing_protocol_unknown": ("tracing:\n  protocol: http/json\n", ("/tracing/protocol",)),
    "tracing_detail_without_engine_traces": (
        "tracing:\n  endpoint: http://c:4317\n  engines: {enabled: false, detailedTraces: model}\n",
        ("tracing.engines.detailedTraces",),
    ),
    "tracing_detail_unknown": (
        "tracing:\n  endpoint: http://c:4317\n  engines: {detailedTraces: gpu}\n",
        ("/tracing/engines/detailedTraces",),
    ),
    "tracing_egress_without_a_peer": (
        "tracing:\n  endpoint: http://c:4317\nnetworkPolicy:\n  egress: {enabled: true}\n",
        ("networkPolicy.egress.tracingTo",),
    ),
    "http_route_without_a_gateway": (
        "router:\n  httpRoute: {enabled: true}\n",
        ("router.httpRoute.parentRefs",),
    ),
    "http_route_backend_timeout_above_request": (
        "router:\n  httpRoute: {enabled: true, parentRefs: [{name: gw}],"
        " timeouts: {request: 1h, backendRequest: 61m}}\n",
        ("router.httpRoute.timeouts.backendRequest", "61m"),
    ),
    "http_route_timeout_not_a_duration": (
        "router:\n  httpRoute: {enabled: true, parentRefs: [{name: gw}], timeouts: {request: 1 hour}}\n",
        ("/router/httpRoute/timeouts/request",),
    ),
    "http_route_parent_without_a_name": (
        "router:\n  httpRoute: {enabled: true, parentRefs: [{namespace: gw}]}\n",
        ("/router/httpRoute/parentRefs/0", "name"),
    ),
    "ingress_path_type_unknown": (
        "router:\n  ingress: {enabled: true, paths: [{path: /v1, pathType: Glob}]}\n",
        ("/router/ingress/paths/0/pathType",),
    ),
    # The flexible layout (engine.layout): one pool of decode engines, each NixlConnector kv_both.
    "unknown_engine_layout": ("engine:\n  layout: mixed\n", ("/engine/layout",)),
    "flexible_with_prefill_engines": (
        "engine:\n  layout: flexible\n",  # prefill.replicas defaults to 1
        ("prefill.replicas", "set prefill.replicas: 0", "decode engine that also prefills"),
    ),
    "flexible_with_prefill_autoscaling": (
        "engine:\n  layout: flexible\nprefill:\n  replicas: 0\n  autoscaling:\n    enabled: true\n"
        "    metrics: [{type: Resource, resource: {name: cpu, target: {type: Utilization, averageUtilization: 50}}}]\n",
        ("prefill.autoscaling.enabled", "engine.layout flexible", "decode.autoscaling"),
    ),
    "flexible_with_multi_node_decode": (
        "engine:\n  layout: flexible\nprefill:\n  replicas: 0\ndecode:\n  nodes: 2\n  tensorParallelSize: 2\n",
        ("decode.nodes", "not checked with NixlConnector kv_both"),
    ),
    "flexible_with_data_parallel_decode": (
        "engine:\n  layout: flexible\n  kvEvents:\n    enabled: false\nprefill:\n  replicas: 0\n"
        "decode:\n  dataParallelSize: 2\n",
        ("decode.dataParallelSize", "not checked with NixlConnector kv_both"),
    ),
    # LoRA adapters (model.lora): what vLLM 0.31.0 refuses at start, or would serve wrong.
    "lora_adapter_named_as_the_model": (
        "model:\n  lora:\n    adapters: [{name: qwen3.5-9b, rank: 8, path: /models/a}]\n",
        ("model.lora.adapters[0].name", "model.servedName"),
    ),
    "lora_adapter_named_twice": (
        "model:\n  lora:\n    adapters: [{name: a, rank: 8, path: /m/a}, {name: a, rank: 8, path: /m/b}]\n",
        ("model.lora.adapters[1].name", "model.lora.adapters[0].name"),
    ),
    # Other releases' models (router.remoteModels): a name of its own, a URL the router can use.
    "remote_model_named_as_the_model": (
        "router:\n  remoteModels: [{name: qwen3.5-9b, url: 'http://b:8000', release: b}]\n",
        ("router.remoteModels[0].name", "model.servedName"),
    ),
    "remote_model_named_as_an_adapter": (
        "model:\n  lora:\n    adapters: [{name: a, rank: 8, path: /m/a}]\n"
        "router:\n  remoteModels: [{name: a, url: 'http://b:8000', release: b}]\n",
        ("router.remoteModels[0].name", "model.lora.adapters[0].name"),
    ),
    "remote_model_named_twice": (
        "router:\n  remoteModels: [{name: b, url: 'http://b:8000', release: b}, {name: b, url: 'http://c:8000', release: c}]\n",
        ("router.remoteModels[1].name", "router.remoteModels[0]"),
    ),
    "remote_model_that_is_this_release": (
        "router:\n  remoteModels: [{name: b, url: 'http://pd-pd-inference-router:8000', release: pd}]\n",
        ("router.remoteModels[0].release", "cannot front itself"),
    ),
    "remote_model_url_with_a_path": (
        "router:\n  remoteModels: [{name: b, url: 'http://b:8000/v1', release: b}]\n",
        ("/router/remoteModels/0/url",),
    ),
    "remote_model_without_its_release": (
        "router:\n  remoteModels: [{name: b, url: 'http://b:8000'}]\n",
        ("/router/remoteModels/0", "release"),
    ),
    "lora_adapter_without_a_source": (
        "model:\n  lora:\n    adapters: [{name: a, rank: 8}]\n",
        ("model.lora.adapters[0]", "exactly one source"),
    ),
    "lora_adapter_with_both_sources": (
        "model:\n  lora:\n    adapters: [{name: a, rank: 8, path: /m/a, hub: {id: o/a, revision: " + "a" * 40 + "}}]\n",
        ("model.lora.adapters[0]", "exactly one source"),
    ),
    "lora_hub_adapter_at_a_branch": (
        "model:\n  lora:\n    adapters: [{name: a, rank: 8, hub: {id: o/a, revision: main}}]\n",
        ("/model/lora/adapters/0/hub/revision",),
    ),
    "lora_hub_adapter_without_preflight": (
        "engine:\n  preflight:\n    enabled: false\nmodel:\n  lora:\n    adapters: [{name: a, rank: 8, hub: "
        "{id: o/a, revision: " + "a" * 40 + "}}]\n",
        ("model.lora.adapters[0].hub", "engine.preflight.enabled"),
    ),
    "lora_rank_above_vllms_largest": (
        "model:\n  lora:\n    adapters: [{name: a, rank: 1024, path: /m/a}]\n",
        ("/model/lora/adapters/0/rank",),
    ),
    "lora_name_with_an_at_sign": (
        "model:\n  lora:\n    adapters: [{name: 'a@b', rank: 8, path: /m/a}]\n",
        ("/model/lora/adapters/0/name",),
    ),
    "lora_more_slots_than_adapters": (
        "model:\n  lora:\n    maxLoras: 2\n    adapters: [{name: a, rank: 8, path: /m/a}]\n",
        ("model.lora.maxLoras",),
    ),
    "lora_cpu_slots_below_gpu_slots": (
        "model:\n  lora:\n    maxLoras: 2\n    maxCpuLoras: 1\n    adapters: [{name: a, rank: 8, path: /m/a}, "
        "{name: b, rank: 8, path: /m/b}]\n",
        ("model.lora.maxCpuLoras", "model.lora.maxLoras"),
    ),
    "lora_with_lmcache": (
        "model:\n  attention: full\n  lora:\n    adapters: [{name: a, rank: 8, path: /m/a}]\n"
        "kvTransfer:\n  connector: lmcache\nrouter:\n  replicas: 1\n  autoscaling:\n    enabled: false\n",
        ("model.lora.adapters", "lmcache", "LMCache's cache key leaves the adapter out"),
    ),
    # The goodput decision's SLOs, as the router refuses them (pd_router.config _validate_goodput).
    "unknown_decision": ("router:\n  decision: fastest\n", ("/router/decision",)),
    "goodput_ttft_of_zero": ("router:\n  goodput:\n    ttftSeconds: 0\n", ("/router/goodput/ttftSeconds",)),
    "goodput_itl_not_a_number": ("router:\n  goodput:\n    itlSeconds: fast\n", ("/router/goodput/itlSeconds",)),
    "goodput_negative_ttft_per_kilo_token": (
        "router:\n  goodput:\n    ttftSecondsPerKiloToken: -0.1\n",
        ("/router/goodput/ttftSecondsPerKiloToken",),
    ),
    "goodput_window_of_zero": ("router:\n  goodput:\n    windowSeconds: 0\n", ("/router/goodput/windowSeconds",)),
    "goodput_negative_seed": (
        "router:\n  goodput:\n    seed:\n      handoffSeconds: -1\n",
        ("/router/goodput/seed/handoffSeconds",),
    ),
    "goodput_unknown_key": ("router:\n  goodput:\n    ttft: 1\n", ("/router/goodput", "ttft")),
}

# The same, layered over tests/values/lmcache.yaml (LMCache PD with a full-attention model): the
# rules that hold only for the LMCache connector.
BAD_LMCACHE_VALUES: dict[str, tuple[str, tuple[str, ...]]] = {
    "undersized_kv_buffer": (
        "model:\n  maxModelLen: 8192\n  kvShape: {layers: 80, kvHeads: 8, headDim: 128, bytesPerElement: 2}\n"
        "kvTransfer:\n  lmcache:\n    bufferSize: 1073741824\n",
        ("kvTransfer.lmcache.bufferSize", "2684354560"),
    ),
    "two_routers_with_lmcache": ("router:\n  replicas: 2\n", ("router.replicas", "prefillSidecar")),
    "two_router_workers_with_lmcache": ("router:\n  workers: 2\n", ("router.workers", "prefillSidecar")),
    "router_hpa_with_lmcache": ("router:\n  autoscaling:\n    enabled: true\n", ("router.autoscaling.enabled",)),
    "unequal_tp_with_lmcache": (
        "prefill:\n  tensorParallelSize: 2\ndecode:\n  tensorParallelSize: 4\n",
        ("decode.tensorParallelSize",),
    ),
    "sidecar_port_collides_with_engine": (
        "kvTransfer:\n  lmcache:\n    notificationReceiver: prefillSidecar\nports:\n  notificationSidecar: 8000\n",
        ("ports.notificationSidecar", "ports.engineHttp"),
    ),
    "sidecar_wait_above_the_routers_limit": (
        "kvTransfer:\n  lmcache:\n    notificationReceiver: prefillSidecar\n    notifyTimeoutSeconds: 900\n",
        ("kvTransfer.lmcache.notifyTimeoutSeconds", "600"),
    ),
    "chunk_above_the_max_model_len": (
        "model:\n  maxModelLen: 4096\nkvTransfer:\n  lmcache:\n    chunkSize: 8192\n",
        ("kvTransfer.lmcache.chunkSize", "model.maxModelLen (4096)"),
    ),
    "lmcache_receiver_ports_beyond_65535": (
        "ports:\n  lmcacheInitBase: 65534\nprefill:\n  tensorParallelSize: 4\ndecode:\n  tensorParallelSize: 4\n",
        ("ports.lmcacheInitBase", "65537"),
    ),
    "decode_env_overrides_the_lmcache_config_file": (
        "decode:\n  env: [{name: LMCACHE_CONFIG_FILE, value: /tmp/x.yaml}]\n",
        ("decode.env", "LMCACHE_CONFIG_FILE"),
    ),
    "multi_node_engines_with_lmcache": (
        "prefill:\n  nodes: 2\n  tensorParallelSize: 2\ndecode:\n  tensorParallelSize: 2\n",
        ("prefill.nodes", "lmcache serves one-node engines"),
    ),
    "data_parallel_engines_with_lmcache": (
        "engine:\n  kvEvents:\n    enabled: false\ndecode:\n  dataParallelSize: 2\n",
        ("decode.dataParallelSize", "lmcache serves one-node engines"),
    ),
    "chart_owned_save_unfull_chunk": (
        "kvTransfer:\n  lmcache:\n    extraConfig:\n      save_unfull_chunk: false\n",
        ("/kvTransfer/lmcache/extraConfig", "save_unfull_chunk"),
    ),
    # LMCache PD's engines are a sender or a receiver, never both.
    "flexible_layout_with_lmcache": (
        "engine:\n  layout: flexible\nprefill:\n  replicas: 0\n",
        ("kvTransfer.connector: lmcache cannot serve engine.layout flexible", "kvTransfer.connector: nixl"),
    ),
    "goodput_decision_with_lmcache": (
        "router:\n  decision: goodput\n",
        ("router.decision: goodput needs kvTransfer.connector: nixl",),
    ),
}


def test_there_are_at_least_fifteen_cases() -> None:
    assert len(BAD_VALUES) + len(BAD_LMCACHE_VALUES) >= 15


def test_a_release_name_too_long_for_the_statefulsets_is_refused(h4: Path) -> None:
    """The generated prefix <release>-pd-inference past 44 characters (it used to be cut to 45,
    one too many for the prefill StatefulSet's controller-revision-hash label)."""
    result = helm.template(h4, release="r" * 33)  # 33 + len("-pd-inference") = 46
    assert result.returncode != 0 and "the release name" in result.stderr and "44" in result.stderr, result.stderr
    assert helm.template(h4, release="r" * 31).returncode == 0  # 44: fits


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


@pytest.mark.parametrize(
    "case",
    [
        "two_routers_with_lmcache",
        "router_hpa_with_lmcache",
        "unequal_tp_with_lmcache",
        "flexible_layout_with_lmcache",
        "goodput_decision_with_lmcache",
    ],
)
def test_lmcache_only_rules_do_not_fire_on_nixl(h4: Path, case: str) -> None:
    """The negative control of the LMCache-only rules: on the NIXL defaults these values render."""
    content, _ = BAD_LMCACHE_VALUES[case]
    result = helm.template(h4, values_yaml=content)
    assert result.returncode == 0, result.stderr


def test_a_release_name_too_long_for_the_worker_statefulsets_is_refused(h4: Path) -> None:
    """A multi-node role's LeaderWorkerSet <prefix>-prefill-lws makes worker StatefulSets
    <lws>-<group> whose pods' controller-revision-hash <sts>-<hash> must fit 63 characters: a
    shorter prefix than a StatefulSet's 44."""
    sets = ("prefill.nodes=2", "prefill.tensorParallelSize=2")
    result = helm.template(h4, sets=sets, release="r" * 26)  # prefix 39: 39 + 12 + 2 + 11 = 64
    assert result.returncode != 0 and "prefill.nodes" in result.stderr and "64 characters" in result.stderr, (
        result.stderr
    )
    assert helm.template(h4, sets=sets, release="r" * 25).returncode == 0
    # LeaderWorkerSet's webhook (v0.9.0) wants a DNS-1035 name: a letter first
    digit = helm.template(h4, sets=sets, release="1pd")
    assert digit.returncode != 0 and "must start with a letter" in digit.stderr, digit.stderr


# The negative controls of the issue 22 rules: values next to the refused ones that render.
GOOD_VALUES: dict[str, tuple[tuple[str, ...], str]] = {
    # every quantity form Kubernetes parses, in each resources block and a chart quantity
    "kubernetes_quantity_forms": (
        (),
        "prefill:\n  resources:\n    requests: {cpu: 4, memory: 1e10}\n    limits: {memory: 64Gi}\n"
        "decode:\n  resources:\n    requests: {cpu: '1.5', memory: 32G}\n    limits: {memory: '+64Gi'}\n"
        "router:\n  resources:\n    requests: {cpu: .5, memory: 512Mi}\n    limits: {cpu: 2000m}\n"
        "engine:\n  metricsProxy:\n    resources:\n      requests: {cpu: 10m, memory: 32768Ki}\n"
        "kvTransfer:\n  lmcache:\n    sidecar:\n      resources:\n        requests: {memory: 0.1Gi}\n"
        "efa:\n  hugepages2Mi: 5Gi\n",
    ),
    # a probe timeout equal to its period, a router check timeout equal to its interval
    "timeouts_equal_to_their_intervals": (
        (),
        "engine:\n  probes:\n    readiness: {periodSeconds: 5, timeoutSeconds: 5}\n"
        "router:\n  health: {intervalSeconds: 2, timeoutSeconds: 2}\n",
    ),
    # the preflight's deadline is not checked against the startup window when it does not run
    "preflight_off_with_a_long_deadline": ((), "engine:\n  preflight: {enabled: false, timeoutSeconds: 3600}\n"),
    # a non-root UID; runAsGroup 0 is not root
    "non_root_user_in_group_zero": ((), "engine:\n  podSecurityContext: {runAsUser: 1000, runAsGroup: 0}\n"),
    # legacy labels that agree with the pinned zone, and node affinity terms (ORed) of which one holds it
    "legacy_labels_agreeing_with_the_zone": (
        (),
        "placement:\n  zone: us-east-1a\ndecode:\n  nodeSelector:\n"
        "    failure-domain.beta.kubernetes.io/zone: us-east-1a\n"
        "    failure-domain.beta.kubernetes.io/region: us-east-1\n"
        "prefill:\n  affinity:\n    nodeAffinity:\n      requiredDuringSchedulingIgnoredDuringExecution:\n"
        "        nodeSelectorTerms:\n"
        "          - matchExpressions:\n"
        "              - {key: failure-domain.beta.kubernetes.io/zone, operator: In, values: [us-east-1c]}\n"
        "          - matchExpressions:\n"
        "              - {key: topology.kubernetes.io/zone, operator: NotIn, values: [us-east-1b]}\n"
        "              - {key: topology.kubernetes.io/region, operator: In, values: [us-east-1]}\n",
    ),
    # EFA with the KV staged in host memory: NIXL registers a cpu buffer with LIBFABRIC too, and
    # instances without GPUDirect RDMA (G-series) need it (docs/values.md, "Allowed on purpose")
    "efa_with_a_cpu_nixl_buffer": (
        (),
        "efa:\n  enabled: true\n  devices: 1\nkvTransfer:\n  nixl:\n    bufferDevice: cpu\n",
    ),
    # issue 26: a two-node engine of tensor parallelism 16 on p5 (8 GPUs a pod), and data +
    # expert parallel over two nodes with the KV events off
    "tensor_parallel_over_two_p5_nodes": (
        (),
        "model:\n  attention: full\n  kvShape: {layers: 126, kvHeads: 8, headDim: 128, bytesPerElement: 2}\n"
        "decode:\n  instanceType: p5.48xlarge\n  nodes: 2\n  tensorParallelSize: 16\n",
    ),
    "data_and_expert_parallel_over_two_nodes": (
        (),
        "engine:\n  kvEvents:\n    enabled: false\n"
        "decode:\n  instanceType: p5.48xlarge\n  nodes: 2\n  dataParallelSize: 16\n  expertParallel: true\n"
        "  groupTopologyKey: topology.k8s.aws/network-node-layer-3\n",
    ),
    # the flexible layout as it must be set, with the prefill role's other values left as they are
    # (prefill.nodes and its extraArgs are not rendered, so not checked), and goodput on split
    "flexible_layout_with_no_prefill_engine": (
        (),
        "engine:\n  layout: flexible\nprefill:\n  replicas: 0\n  nodes: 2\n  tensorParallelSize: 2\n"
        "  extraArgs: [--tensor-parallel-size=4]\nrouter:\n  decision: goodput\n",
    ),
    # another release's model next to this release's adapters, its router in another namespace
    "remote_models_beside_adapters": (
        (),
        "model:\n  lora:\n    adapters: [{name: a, rank: 8, path: /m/a}]\n"
        "router:\n  remoteModels:\n    - {name: b, url: 'https://b-router.llm.svc:8000/', release: b, namespace: llm}\n"
        "networkPolicy:\n  egress: {enabled: true}\n",
    ),
    "goodput_decision_on_split_engines": (
        (),
        "router:\n  decision: goodput\n  goodput:\n    ttftSecondsPerKiloToken: 0\n    seed: {prefillTokensPerSecond: 20000.5}\n",
    ),
    "efa_with_a_cpu_lmcache_buffer": (
        (LMCACHE,),
        "efa:\n  enabled: true\n  devices: 1\nkvTransfer:\n  lmcache:\n    bufferDevice: cpu\n",
    ),
}


@pytest.mark.parametrize("case", GOOD_VALUES)
def test_values_next_to_the_refused_ones_render(h4: Path, case: str) -> None:
    base, content = GOOD_VALUES[case]
    result = helm.template(h4, base, values_yaml=content)
    assert result.returncode == 0, result.stderr
