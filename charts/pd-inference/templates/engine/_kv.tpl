{{/*
KV hand-off configuration, built as data and rendered with toJson/toYaml, never pasted into strings.

Protocol facts checked against (see ../shared/design/pd-protocols.md):
- LMCache PD keys, types and the ProxyNotif flow: lmcache 0.5.6 (lmcache/v1/config.py, the
  pd_backend): ports are lists of ints indexed by TP rank, pd_buffer_size is bytes per worker.
  Retired keys (enable_nixl, nixl_role, nixl_receiver_host, nixl_receiver_port) are only logged as
  unknown by LMCache, so they are never rendered and tests/ check every key against 0.5.6's list.
  save_unfull_chunk is rendered true: LMCache 0.5.6 forces it for enable_pd (with a warning on
  every start) because a dropped partial last chunk would leave the decoder with incomplete KV.
- kv-transfer-config shapes: with each connector's own, in templates/_connectors.tpl.
*/}}

{{/* --kv-transfer-config for a role, as JSON: the connector's own (templates/_connectors.tpl). Call with (dict "ctx" $ "role" "prefill"). */}}
{{- define "pd-inference.kvTransferConfig" -}}
{{- include (printf "pd-inference.connectors.%s.kvTransferConfig" .ctx.Values.kvTransfer.connector) . -}}
{{- end -}}

{{/* LMCache config file for a role, as a YAML document. Call with (dict "ctx" $ "role" "prefill"). */}}
{{- define "pd-inference.lmcacheConfig" -}}
{{- $v := .ctx.Values -}}
{{- $lm := $v.kvTransfer.lmcache -}}
{{- $cfg := dict
  "chunk_size" (int $lm.chunkSize)
  "local_cpu" false
  "enable_pd" true
  "transfer_channel" "nixl"
  "nixl_backends" (list (include "pd-inference.nixlBackend" .ctx))
  "pd_buffer_size" (int64 $lm.bufferSize)
  "pd_buffer_device" $lm.bufferDevice
  "save_unfull_chunk" true
-}}
{{- if eq .role "prefill" -}}
{{- $_ := set $cfg "pd_role" "sender" -}}
{{- /* The sidecar listens inside the prefill pod; otherwise the (single) router's Service. */ -}}
{{- $_ := set $cfg "pd_proxy_host" (ternary "127.0.0.1" (include "pd-inference.serviceFqdn" (dict "ctx" .ctx "component" "router")) (eq (include "pd-inference.notificationSidecar" .ctx) "true")) -}}
{{- $notify := ternary (dict "component" "prefill" "name" "notify-zmq") (dict "component" "router" "name" "pd-notify") (eq $lm.notificationReceiver "prefillSidecar") -}}
{{- $_ := set $cfg "pd_proxy_port" (include "pd-inference.port" (merge (dict "ctx" .ctx "connector" "lmcache") $notify) | int) -}}
{{- else -}}
{{- $_ := set $cfg "pd_role" "receiver" -}}
{{- /* Bind on every interface; the router tells the sender this pod's IP in disagg_spec.receiver_host. */ -}}
{{- $_ := set $cfg "pd_peer_host" "0.0.0.0" -}}
{{- $receiverPorts := dict "ctx" .ctx "component" "decode" "connector" "lmcache" -}}
{{- $_ := set $cfg "pd_peer_init_port" (include "pd-inference.portNumbers" (merge (dict "field" "ports.lmcacheInitBase") $receiverPorts) | fromJsonArray) -}}
{{- $_ := set $cfg "pd_peer_alloc_port" (include "pd-inference.portNumbers" (merge (dict "field" "ports.lmcacheAllocBase") $receiverPorts) | fromJsonArray) -}}
{{- end -}}
{{- /* extraConfig keys were checked against LMCache's key list by the schema; chart-owned keys are refused in _validate.tpl. */ -}}
{{- $merged := merge (deepCopy $lm.extraConfig) $cfg -}}
{{- toYaml $merged -}}
{{- end -}}

{{/*
KV bytes of one max-length request held by ONE engine worker (TP rank), for the pd_buffer_size
check: LMCache gives every worker its own buffer, and tensor parallelism splits the KV heads over
the ranks (a rank holds at least one head). So: 2 (K and V) x layers x ceil(KV heads / TP) x head
dim x bytes per element x tokens, with tokens rounded up to whole LMCache chunks.
*/}}
{{- define "pd-inference.kvBytesPerRequest" -}}
{{- $v := .Values -}}
{{- $s := $v.model.kvShape -}}
{{- $chunk := int64 $v.kvTransfer.lmcache.chunkSize -}}
{{- $tokens := mul (div (add (int64 $v.model.maxModelLen) (sub $chunk 1)) $chunk) $chunk -}}
{{- $tp := int64 $v.decode.tensorParallelSize -}}
{{- $headsPerRank := div (add (int64 $s.kvHeads) (sub $tp 1)) $tp -}}
{{- mul 2 (int64 $s.layers) $headsPerRank (int64 $s.headDim) (int64 $s.bytesPerElement) $tokens -}}
{{- end -}}
