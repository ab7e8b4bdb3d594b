{{/* The KV hand-off: the connector against the model and the layout, LMCache's notifications and keys, the KV buffer, the transport over EFA. Included by pd-inference.validate (templates/_validate.tpl), in its order. */}}

{{- define "pd-inference.validate.model" -}}
{{- $v := .Values -}}
{{- $connector := include "pd-inference.connector" . | fromJson -}}
{{- /*
What the pinned vLLM can serve (templates/_connectors.tpl hybridModels). LMCacheConnectorV1 does
not implement vLLM's SupportsHMA (vLLM 0.31.0 and 0.33.0: kv_connector/v1/lmcache_connector.py),
so with a hybrid model vLLM turns the hybrid KV-cache manager off and the model fails at start-up
or when a request finishes (the scheduler asserts one KV-cache group). NixlConnector implements
SupportsHMA. The real-engine tier (tests/engines/) checks both facts against the installed vLLM
versions.
*/ -}}
{{- if and (not $connector.hybridModels) (eq (include "pd-inference.hybridModel" .) "true") -}}
{{- $why := ternary "model.attention is hybrid" "model.name is a hybrid model family (linear-attention or Mamba layers besides attention; set model.attention: full only if this model has attention in every layer)" (eq $v.model.attention "hybrid") -}}
{{- fail (printf "kvTransfer.connector: %s cannot serve %s: %s, and vLLM's %s does not support hybrid KV-cache models (no SupportsHMA in vLLM %s); use kvTransfer.connector: %s, or a full-attention model" $connector.name $v.model.name $why $connector.vllmConnector (index .Chart.Annotations "pd-inference.io/checked-vllm" | replace "," ", ") (include "pd-inference.connectorsWhere" (dict "ctx" . "fact" "hybridModels" "set" true))) -}}
{{- end -}}
{{- end -}}

{{- /*
LoRA adapters (model.lora, engine/_args.tpl loraArgs): what vLLM 0.31.0 would refuse at start,
or serve wrong, named here. The schema has each adapter's fields.
*/ -}}
{{- define "pd-inference.validate.lora" -}}
{{- $v := .Values -}}
{{- $l := $v.model.lora -}}
{{- $connector := include "pd-inference.connector" . | fromJson -}}
{{- with $l.adapters -}}
{{- if $connector.noLora -}}
{{- fail (printf "model.lora.adapters: kvTransfer.connector %s cannot serve LoRA adapters: %s; use kvTransfer.connector: %s, or no adapters" $connector.name $connector.noLora (include "pd-inference.connectorsWhere" (dict "ctx" $ "fact" "noLora" "set" false))) -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $i, $a := . -}}
{{- $field := printf "model.lora.adapters[%d]" $i -}}
{{- if eq $a.name $v.model.servedName -}}
{{- fail (printf "%s.name: %q is model.servedName; an adapter needs a name of its own (clients put it in `model`)" $field $a.name) -}}
{{- end -}}
{{- if hasKey $seen $a.name -}}
{{- fail (printf "%s.name: %q is also model.lora.adapters[%d].name; each adapter needs a name of its own" $field $a.name (get $seen $a.name)) -}}
{{- end -}}
{{- $_ := set $seen $a.name $i -}}
{{- if eq (empty $a.path) (empty $a.hub) -}}
{{- fail (printf "%s: give exactly one source, `path` (a folder in the engine container) or `hub` ({id, revision})" $field) -}}
{{- end -}}
{{- if and $a.hub (not $v.engine.preflight.enabled) -}}
{{- fail (printf "%s.hub: a hub adapter is downloaded at its pinned revision by the engine preflight (vLLM's own download takes no revision), which engine.preflight.enabled turns off; turn it on, or give a `path`" $field) -}}
{{- end -}}
{{- end -}}
{{- if gt (int $l.maxLoras) (len .) -}}
{{- fail (printf "model.lora.maxLoras: %d slots for %d adapter(s); each slot reserves GPU memory for an adapter at --max-lora-rank, so at most %d" (int $l.maxLoras) (len .) (len .)) -}}
{{- end -}}
{{- if and (gt (int $l.maxCpuLoras) 0) (lt (int $l.maxCpuLoras) (int $l.maxLoras)) -}}
{{- fail (printf "model.lora.maxCpuLoras: %d is below model.lora.maxLoras (%d), which vLLM refuses at start (max_cpu_loras must be at least max_loras); raise it, or 0 for every adapter" (int $l.maxCpuLoras) (int $l.maxLoras)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /*
LMCache's MP mode beside the NIXL hand-off (kvTransfer.nixl.lmcacheMp): what it cannot serve,
named. Its cache key has no adapter (LMCache 0.5.6's MP keys, like its in-process ones: vLLM
issue 44250); a hybrid model's MP KV was reported silently wrong (LMCache issue 4247, fix open
when checked, 2026-12); the server runs in the engine's pod, where a multi-node engine's workers
have none.
*/ -}}
{{- define "pd-inference.validate.lmcacheMp" -}}
{{- $v := .Values -}}
{{- if $v.kvTransfer.nixl.lmcacheMp.enabled -}}
{{- $f := "kvTransfer.nixl.lmcacheMp.enabled" -}}
{{- if ne $v.kvTransfer.connector "nixl" -}}
{{- fail (printf "%s: LMCache's MP mode rides on the NIXL hand-off (vLLM's MultiConnector of NixlConnector and LMCacheMPConnector), and kvTransfer.connector is %s; use kvTransfer.connector: nixl, or turn it off" $f $v.kvTransfer.connector) -}}
{{- end -}}
{{- if $v.model.lora.adapters -}}
{{- fail (printf "%s: LMCache's MP cache key leaves the LoRA adapter out (vLLM issue 44250), so one adapter's request could load another's KV; model.lora.adapters needs it off" $f) -}}
{{- end -}}
{{- if eq (include "pd-inference.hybridModel" .) "true" -}}
{{- fail (printf "%s: %s is a hybrid model, whose KV LMCache's MP mode was reported to load wrong (LMCache issue 4247, open when the chart was checked); turn it off for this model" $f $v.model.name) -}}
{{- end -}}
{{- range $role := include "pd-inference.engineRoles" . | fromJsonArray -}}
{{- if gt (int ((get $v $role).nodes | default 1)) 1 -}}
{{- fail (printf "%s: %s.nodes is %d, and the LMCache server runs in the engine's pod, where the other nodes' vLLM workers have none; turn it off for multi-node engines" $f $role (int (get $v $role).nodes)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.layout" -}}
{{- $v := .Values -}}
{{- $connector := include "pd-inference.connector" . | fromJson -}}
{{- /* The flexible layout (engine.layout): one pool of decode engines, each NixlConnector kv_both. */ -}}
{{- if include "pd-inference.flexible" . -}}
{{- if $connector.fixedRoles -}}
{{- fail (printf "kvTransfer.connector: %s cannot serve engine.layout flexible: %s, and a flexible engine takes either part; use kvTransfer.connector: %s, or engine.layout: split" $connector.name $connector.fixedRoles (include "pd-inference.connectorsWhere" (dict "ctx" . "fact" "fixedRoles" "set" false))) -}}
{{- end -}}
{{- if gt (int $v.prefill.replicas) 0 -}}
{{- fail (printf "prefill.replicas: %d prefill engines with engine.layout flexible; set prefill.replicas: 0, every engine is a decode engine that also prefills (decode.replicas counts them)" (int $v.prefill.replicas)) -}}
{{- end -}}
{{- if $v.prefill.autoscaling.enabled -}}
{{- fail "prefill.autoscaling.enabled: no prefill engine runs with engine.layout flexible (every engine is a decode engine that also prefills); autoscale the pool with decode.autoscaling instead" -}}
{{- end -}}
{{- /* NixlConnector's kv_both on a multi-node or data-parallel engine is not checked here (the
real-engine tier runs one-node engines of one rank with it): refused until it is. */ -}}
{{- if gt (int $v.decode.nodes) 1 -}}
{{- fail (printf "decode.nodes: %d nodes per engine with engine.layout flexible; multi-node engines are not checked with NixlConnector kv_both, so set decode.nodes: 1 (or engine.layout: split)" (int $v.decode.nodes)) -}}
{{- end -}}
{{- if gt (int $v.decode.dataParallelSize) 1 -}}
{{- fail (printf "decode.dataParallelSize: %d data-parallel ranks with engine.layout flexible; data-parallel engines are not checked with NixlConnector kv_both, so set decode.dataParallelSize: 1 (or engine.layout: split)" (int $v.decode.dataParallelSize)) -}}
{{- end -}}
{{- end -}}
{{- /* The goodput decision names the prefiller and the decoder of each hand-off: the connectors with goodput (pd_router.config). */ -}}
{{- if and (not $connector.goodput) (eq $v.router.decision "goodput") -}}
{{- $able := include "pd-inference.connectorsWhere" (dict "ctx" . "fact" "goodput" "set" true) -}}
{{- fail (printf "router.decision: goodput needs kvTransfer.connector: %s, as the router does (it names the prefiller and the decoder of each hand-off); use kvTransfer.connector: %s, or router.decision: prefix or length" $able $able) -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.notifications" -}}
{{- $v := .Values -}}
{{- $connector := include "pd-inference.connector" . | fromJson -}}
{{- $unnotified := include "pd-inference.connectorsWhere" (dict "ctx" . "fact" "notifications" "set" false) -}}
{{- /* One notification host in LMCache mode: several routers would miss each other's notifications. */ -}}
{{- $single := eq (include "pd-inference.routerReceivesNotifications" .) "true" -}}
{{- if and $single (gt (int $v.router.replicas) 1) -}}
{{- fail (printf "router.replicas: %d router replicas need kvTransfer.lmcache.notificationReceiver=prefillSidecar (or kvTransfer.connector=%s); with notificationReceiver=router the prefillers notify a single router (pd_proxy_host)" (int $v.router.replicas) $unnotified) -}}
{{- end -}}
{{- if lt (int $v.router.health.maxEjectionSeconds) (int $v.router.health.ejectionSeconds) -}}
{{- fail (printf "router.health.maxEjectionSeconds: must be >= router.health.ejectionSeconds (%d), got %d" (int $v.router.health.ejectionSeconds) (int $v.router.health.maxEjectionSeconds)) -}}
{{- end -}}
{{- if and $single (gt (int $v.router.workers) 1) -}}
{{- fail (printf "router.workers: %d worker processes need kvTransfer.lmcache.notificationReceiver=prefillSidecar (or kvTransfer.connector=%s); with notificationReceiver=router one process binds the notification socket" (int $v.router.workers) $unnotified) -}}
{{- end -}}
{{- if and $single $v.router.autoscaling.enabled -}}
{{- fail (printf "router.autoscaling.enabled: router autoscaling needs kvTransfer.lmcache.notificationReceiver=prefillSidecar (or kvTransfer.connector=%s); with notificationReceiver=router the prefillers notify a single router" $unnotified) -}}
{{- end -}}
{{- if and $connector.equalTensorParallel (ne (int $v.prefill.tensorParallelSize) (int $v.decode.tensorParallelSize)) -}}
{{- fail (printf "decode.tensorParallelSize: %s, so prefill.tensorParallelSize (%d) and decode.tensorParallelSize (%d) must be equal" $connector.equalTensorParallel (int $v.prefill.tensorParallelSize) (int $v.decode.tensorParallelSize)) -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.kvBuffer" -}}
{{- $v := .Values -}}
{{- $lmcache := eq $v.kvTransfer.connector "lmcache" -}}
{{- /* KV buffer large enough for one max-length request (pd-protocols.md section 4). */ -}}
{{- $shape := $v.model.kvShape -}}
{{- if gt (int $shape.layers) 0 -}}
{{- range $f := list "kvHeads" "headDim" "bytesPerElement" -}}
{{- if le (int (get $shape $f)) 0 -}}
{{- fail (printf "model.kvShape.%s: must be > 0 when model.kvShape.layers is set" $f) -}}
{{- end -}}
{{- end -}}
{{- if $lmcache -}}
{{- $need := include "pd-inference.kvBytesPerRequest" . | int64 -}}
{{- if lt (int64 $v.kvTransfer.lmcache.bufferSize) $need -}}
{{- fail (printf "kvTransfer.lmcache.bufferSize: %d bytes per worker cannot hold one TP rank's share of the KV of a %d-token request (%d bytes for model.kvShape at tensorParallelSize %d)" (int64 $v.kvTransfer.lmcache.bufferSize) (int $v.model.maxModelLen) $need (int $v.decode.tensorParallelSize)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* LMCache keys the chart owns cannot be overridden through extraConfig. */ -}}
{{- range $line := .Files.Lines "files/lmcache-chart-owned-keys.txt" -}}
{{- $key := trim $line -}}
{{- if and $key (not (hasPrefix "#" $key)) (hasKey $v.kvTransfer.lmcache.extraConfig $key) -}}
{{- fail (printf "kvTransfer.lmcache.extraConfig.%s: this LMCache key is set by the chart; use the matching kvTransfer/ports value instead" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.kvOverEfa" -}}
{{- $v := .Values -}}
{{- $lmcache := eq $v.kvTransfer.connector "lmcache" -}}
{{- /* KV transfer over EFA: UCX has no EFA transport (NIXL's LIBFABRIC backend drives EFA). */ -}}
{{- if and $v.efa.enabled (eq $v.kvTransfer.backend "UCX") -}}
{{- fail "kvTransfer.backend: UCX cannot use EFA devices (UCX has no EFA transport); use LIBFABRIC, or auto (LIBFABRIC with EFA), or turn efa.enabled off" -}}
{{- end -}}
{{- if and $lmcache (gt (int $v.kvTransfer.lmcache.chunkSize) (int $v.model.maxModelLen)) -}}
{{- fail (printf "kvTransfer.lmcache.chunkSize: %d tokens per chunk is above model.maxModelLen (%d): no request would fill a chunk" (int $v.kvTransfer.lmcache.chunkSize) (int $v.model.maxModelLen)) -}}
{{- end -}}
{{- end -}}
