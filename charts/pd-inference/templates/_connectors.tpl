{{/*
THE KV hand-off connectors (kvTransfer.connector): one entry each, with the facts the checks and
the other templates ask, then each connector's own pieces. No other template compares
kvTransfer.connector to a name, except around LMCache's own objects (its config file and its
ConfigMaps, the checks of kvTransfer.lmcache.* values), which no other connector has.

The router keeps the same list (router/src/pd_router/connectors.py), the schema's enum is
generated from it (ci/chartdoc.py, type=connector), and tests/test_connectors.py fails when the
names, or the facts both keep (fixedRoles, goodput, notifications, noLora), differ. A connector's
settings are kvTransfer.<name>, with a bufferDevice (the engine preflight checks it).

A third connector: an entry here, its pieces below, its settings in values.yaml, and its entry
in the router's list.

Facts:
  vllmConnector        the kv_connector of its --kv-transfer-config
  fixedRoles           why one engine cannot both send and receive, which engine.layout flexible
                       needs (every engine prefills for another and decodes what another
                       prefilled); "" = it can
  goodput              router.decision goodput can drive it (the router names the prefiller and
                       the decoder of each hand-off)
  notifications        the prefillers announce that the KV landed, received as
                       kvTransfer.lmcache.notificationReceiver says: the router, or a sidecar in
                       each prefill pod
  hybridModels         vLLM's connector serves hybrid KV-cache models (SupportsHMA)
  noLora               why it cannot serve LoRA adapters (model.lora.adapters); "" = it can
  oneRankEngines       why it serves only one-node engines of one data-parallel rank; "" = any
  equalTensorParallel  why prefill and decode need one tensorParallelSize; "" = they need not
  kvRevision           what the KV revision (engine/_revision.tpl) hashes besides the shared
                       inputs: its key -> the value of kvTransfer.<name> (an integer) it takes

Pieces, each a named template pd-inference.connectors.<name>.<piece>:
  kvTransferConfig  (dict "ctx" $ "role" "prefill"): its --kv-transfer-config, as JSON
  env               (dict "ctx" $ "role" "prefill"): its entries of the engine env, YAML
  ports             (dict "ctx" $ "component" c "receiver" r), r the pd-inference.ports call's
                    or "", plus "other" and "otherDoc" for an engine role (who moves KV with its
                    pods): the ports it opens in the component's pods, a JSON list of
                    _ports.tpl's shape
  alerts            (dict "ctx" $ "s" "dec" "by" "long" and the thresholds "t"), the
                    selectors and aggregation of observability/prometheusrule.yaml: its alerts,
                    a JSON list of that file's shape
*/}}
{{- define "pd-inference.connectors" -}}
{{- dict
  "nixl" (dict
    "vllmConnector" "NixlConnector"
    "fixedRoles" ""
    "goodput" true
    "notifications" false
    "hybridModels" true
    "noLora" ""
    "oneRankEngines" ""
    "equalTensorParallel" ""
    "kvRevision" dict)
  "lmcache" (dict
    "vllmConnector" "LMCacheConnectorV1"
    "fixedRoles" "an LMCache PD engine is a sender or a receiver (pd_role), never both"
    "goodput" false
    "notifications" true
    "hybridModels" false
    "noLora" "LMCache's cache key leaves the adapter out (LMCache 0.5.6 lmcache/utils.py CacheEngineKey: the model, world size, worker, the tokens' hash, dtype and tags; LMCache issue 2961, vLLM issue 44250), so a request for one adapter could be served another's KV or the base model's"
    "oneRankEngines" "LMCache PD's config names one decoder host per engine with one receiver port per TP rank (vLLM ranks on other pods, or other DP ranks, are not addressed)"
    "equalTensorParallel" "LMCache PD sends one KV shard and one notification per TP rank"
    "kvRevision" (dict "lmcacheChunkSize" "chunkSize"))
| toJson -}}
{{- end -}}

{{/* The release's connector (kvTransfer.connector): its entry, as JSON, its name under "name". */}}
{{- define "pd-inference.connector" -}}
{{- $name := .Values.kvTransfer.connector -}}
{{- $entry := get (include "pd-inference.connectors" . | fromJson) $name -}}
{{- if not $entry -}}
{{- fail (printf "chart bug: kvTransfer.connector %s has no entry in templates/_connectors.tpl" $name) -}}
{{- end -}}
{{- set $entry "name" $name | toJson -}}
{{- end -}}

{{/*
The connectors that have a fact (true, or a reason given) with "set" true, or lack it with "set"
false, as a rule's "use kvTransfer.connector: ..." names them: "nixl", or "a or b".
Call with (dict "ctx" $ "fact" "goodput" "set" true).
*/}}
{{- define "pd-inference.connectorsWhere" -}}
{{- $names := list -}}
{{- range $name, $c := include "pd-inference.connectors" .ctx | fromJson -}}
{{- if eq (not (empty (get $c $.fact))) $.set -}}
{{- $names = append $names $name -}}
{{- end -}}
{{- end -}}
{{- join " or " $names -}}
{{- end -}}

{{/*
Protocol facts of the pieces, checked against (see ../shared/design/pd-protocols.md): the
kv-transfer-config shapes (LMCacheConnectorV1, NixlConnector with top-level
kv_load_failure_policy, kv_buffer_device and kv_connector_extra_config.backends): vLLM 0.31.0
and 0.33.0 (KVTransferConfig; tests/engines/ parses every rendered one with both, and
tests/real_engine/ serves the dev environment's with vLLM 0.31.0's CPU build).
*/}}

{{- /* ---------------------------------------------------------------- nixl: vLLM's NixlConnector */ -}}

{{- define "pd-inference.connectors.nixl.kvTransferConfig" -}}
{{- $v := .ctx.Values -}}
{{- $extra := dict "backends" (list (include "pd-inference.nixlBackend" .ctx)) -}}
{{- /* Split: producer on prefill, consumer on decode. vLLM 0.31 and 0.33 deprecate kv_both for
NixlConnector ("set kv_producer for prefill instances and kv_consumer for decode instances",
kv_connector/v1/nixl/connector.py); a consumer still serves whole requests (short prompts,
fallbacks). Flexible (engine.layout): kv_both all the same, on the decode engines, the only
ones: each prefills for another and decodes what another prefilled, and an engine that takes
either part needs kv_both; those vLLM versions log their deprecation warning for it at start-up
and run it. */ -}}
{{- $role := ternary "kv_producer" "kv_consumer" (eq .role "prefill") -}}
{{- if include "pd-inference.flexible" .ctx -}}
{{- $role = "kv_both" -}}
{{- end -}}
{{- $connector := (include "pd-inference.connector" .ctx | fromJson).vllmConnector -}}
{{- $nixl := dict "kv_connector" $connector "kv_role" $role "kv_load_failure_policy" $v.kvTransfer.nixl.loadFailurePolicy "kv_buffer_device" $v.kvTransfer.nixl.bufferDevice "kv_connector_extra_config" $extra -}}
{{- if include "pd-inference.lmcacheMp" .ctx -}}
{{- /* LMCache's MP mode (kvTransfer.nixl.lmcacheMp), the shape of LMCache's docs
(mp/disaggregated_prefill): MultiConnector, NixlConnector first, LMCacheMPConnector second. vLLM
0.31.0 / 0.33.0 multi_connector.py: a request loads from the first child that reports tokens
(a decode leg's do_remote_prefill: NIXL's), every child saves; the children's
kv_transfer_params are merged and LMCache's adds none, so the router's NIXL protocol is
unchanged. The scheduler reads kv_load_failure_policy from the top level only
(v1/core/sched/scheduler.py), so it is set there too. LMCacheMPConnector (LMCache 0.5.6's own
class, which vLLM 0.31 prefers to its copy) stores only where its own kv_role is a producer:
kv_both on every engine, as LMCache's docs render it. Its server is the pod's lmcache-server
container, on 127.0.0.1, both engine-driven (engine/_pod.tpl lmcacheServer says why). */ -}}
{{- $port := include "pd-inference.port" (dict "ctx" .ctx "component" .role "name" "lmcache-mp") | int -}}
{{- $lmcache := dict "kv_connector" "LMCacheMPConnector" "kv_role" "kv_both" "kv_connector_extra_config" (dict "lmcache.mp.host" "tcp://127.0.0.1" "lmcache.mp.port" $port "lmcache.mp.mp_transfer_mode" "engine_driven") -}}
{{- $nixl = dict "kv_connector" "MultiConnector" "kv_role" $role "kv_load_failure_policy" $v.kvTransfer.nixl.loadFailurePolicy "kv_buffer_device" $v.kvTransfer.nixl.bufferDevice "kv_connector_extra_config" (dict "connectors" (list $nixl $lmcache)) -}}
{{- end -}}
{{- $nixl | toJson -}}
{{- end -}}

{{- define "pd-inference.connectors.nixl.env" -}}
# NixlConnector's side channel: bind on, and advertise, this pod's IP.
- name: VLLM_NIXL_SIDE_CHANNEL_HOST
  value: $(POD_IP)
- name: VLLM_NIXL_SIDE_CHANNEL_PORT
  value: {{ include "pd-inference.port" (dict "ctx" .ctx "component" .role "name" "nixl-side") | quote }}
# NixlConnector moves a hybrid model's Mamba/Gated-DeltaNet conv state only in the
# (dim, state_len) layout; without this vLLM 0.31/0.33 assert at start-up
# (kv_connector/v1/nixl/base_worker.py: "Set VLLM_SSM_CONV_STATE_LAYOUT=DS"). Set on every
# NIXL engine, as vLLM's CPU platform does (platforms/cpu.py): only Mamba-type layers
# read it, and a hybrid model the chart does not recognise by name still starts.
- name: VLLM_SSM_CONV_STATE_LAYOUT
  value: DS
{{- end -}}

{{- define "pd-inference.connectors.nixl.ports" -}}
{{- $v := .ctx.Values -}}
{{- $p := list -}}
{{- if ne .component "router" -}}
{{- $p = append $p (dict "name" "nixl-side" "port" (int $v.ports.nixlSideChannel) "field" "ports.nixlSideChannel" "container" "vllm" "service" true "from" (list .other) "doc" (printf "vLLM NixlConnector side channel (handshake metadata), from %s." .otherDoc)) -}}
{{- $dp := int ((get $v .component).dataParallelSize | default 1) -}}
{{- if gt $dp 1 -}}
{{- /* Data-parallel rank i's side channel listens on ports.nixlSideChannel + i, on the pod that runs it
(vLLM 0.31.0 / 0.33.0, nixl/base_scheduler.py); the router reaches only the API, so only the range's rule. */ -}}
{{- $p = append $p (dict "name" "nixl-side-dp" "port" (add $v.ports.nixlSideChannel 1) "endPort" (add $v.ports.nixlSideChannel (sub $dp 1)) "field" "ports.nixlSideChannel" "container" "" "service" false "from" (list .other) "doc" (printf "The side channels of data-parallel ranks 1 and up (ports.nixlSideChannel + rank), from %s." .otherDoc)) -}}
{{- end -}}
{{- if .lmcacheMp -}}
{{- /* The pod's LMCache MP server (kvTransfer.nixl.lmcacheMp): its requests and its HTTP API
(the probes), both on 127.0.0.1; nobody else may connect. */ -}}
{{- $p = append $p (dict "name" "lmcache-mp" "port" (int $v.ports.lmcacheMpServer) "field" "ports.lmcacheMpServer" "container" "" "service" false "from" list "doc" "") -}}
{{- $p = append $p (dict "name" "lmcache-http" "port" (int $v.ports.lmcacheMpHttp) "field" "ports.lmcacheMpHttp" "container" "" "service" false "from" list "doc" "") -}}
{{- end -}}
{{- end -}}
{{- toJson $p -}}
{{- end -}}

{{- define "pd-inference.connectors.nixl.alerts" -}}
{{- $policy := .ctx.Values.kvTransfer.nixl.loadFailurePolicy -}}
{{- list (dict
  "alert" "PDInferenceNixlTransferFailures" "for" "5m" "severity" "warning"
  "expr" (printf "%s (rate(vllm:nixl_num_failed_transfers_total{%s}[10m])) > 0" .by .dec)
  "summary" "NIXL KV transfers fail on the decoders"
  "description" (printf "Decoders in {{ $labels.namespace }}/{{ $labels.release }} report failed NIXL transfers ({{ $value }}/s); with kvTransfer.nixl.loadFailurePolicy %s vLLM %s." $policy (ternary "recomputes those prompts locally" "fails those requests" (eq $policy "recompute")))) | toJson -}}
{{- end -}}

{{- /* ------------------------------------------------------- lmcache: LMCache PD over NIXL */ -}}

{{- define "pd-inference.connectors.lmcache.kvTransferConfig" -}}
{{- $extra := dict "discard_partial_chunks" false -}}
{{- $role := "kv_consumer" -}}
{{- if eq .role "prefill" -}}
{{- $_ := set $extra "lmcache_rpc_port" "producer1" -}}
{{- $role = "kv_producer" -}}
{{- else -}}
{{- $_ := set $extra "lmcache_rpc_port" "consumer1" -}}
{{- $_ := set $extra "skip_last_n_tokens" 1 -}}
{{- end -}}
{{- $connector := (include "pd-inference.connector" .ctx | fromJson).vllmConnector -}}
{{- dict "kv_connector" $connector "kv_role" $role "kv_connector_extra_config" $extra | toJson -}}
{{- end -}}

{{- define "pd-inference.connectors.lmcache.env" -}}
- name: LMCACHE_CONFIG_FILE
  value: /etc/lmcache/lmcache.yaml
{{- end -}}

{{- define "pd-inference.connectors.lmcache.ports" -}}
{{- $v := .ctx.Values -}}
{{- $c := .component -}}
{{- $receiver := .receiver | default $v.kvTransfer.lmcache.notificationReceiver -}}
{{- $p := list -}}
{{- if and (eq $c "router") (eq $receiver "router") -}}
{{- $p = append $p (dict "name" "pd-notify" "port" (int $v.ports.proxyNotification) "field" "ports.proxyNotification" "container" "router" "service" true "from" (list "prefill") "doc" "Prefillers' KV-landed notifications." "serviceDoc" "Prefillers PUSH their KV-landed notifications (LMCache ProxyNotif over ZMQ) here.") -}}
{{- end -}}
{{- if eq $c "decode" -}}
{{- $doc := "LMCache NIXL handshake and buffer allocation, one port pair per TP rank, from prefillers." -}}
{{- range $rank := until (int $v.decode.tensorParallelSize) -}}
{{- $p = append $p (dict "name" (printf "lmc-init-%d" $rank) "port" (add $v.ports.lmcacheInitBase $rank) "field" "ports.lmcacheInitBase" "rank" $rank "container" "vllm" "service" true "from" (list "prefill") "doc" $doc) -}}
{{- $p = append $p (dict "name" (printf "lmc-alloc-%d" $rank) "port" (add $v.ports.lmcacheAllocBase $rank) "field" "ports.lmcacheAllocBase" "rank" $rank "container" "vllm" "service" true "from" (list "prefill") "doc" $doc) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $c "prefill") (eq $receiver "prefillSidecar") -}}
{{- $p = append $p (dict "name" "notify-sidecar" "port" (int $v.ports.notificationSidecar) "field" "ports.notificationSidecar" "container" "notify-sidecar" "service" true "from" (list "router") "doc" "The notification sidecar, asked by the router whether a request's KV has landed.") -}}
{{- /* The sidecar's ZMQ PULL socket, on 127.0.0.1: the pod's prefiller pushes there (pd_proxy_port). */ -}}
{{- $p = append $p (dict "name" "notify-zmq" "port" (int $v.ports.proxyNotification) "field" "ports.proxyNotification" "container" "" "service" false "from" list "doc" "") -}}
{{- end -}}
{{- toJson $p -}}
{{- end -}}

{{- define "pd-inference.connectors.lmcache.alerts" -}}
{{- list (dict
  "alert" "PDInferenceLMCacheNotificationTimeouts" "for" "10m" "severity" "warning"
  "expr" (printf "%s (rate(pd_router_fallbacks_total{%s,reason=\"notify_timeout\"}[10m]))\n/\n%s %s > %v" .by .s .by .long .t.notifyTimeoutShare)
  "summary" "LMCache hand-off notifications time out"
  "description" "{{ $value | humanizePercentage }} of long prompts in {{ $labels.namespace }}/{{ $labels.release }} waited kvTransfer.lmcache.notifyTimeoutSeconds for the prefiller's notification and fell back.") | toJson -}}
{{- end -}}
