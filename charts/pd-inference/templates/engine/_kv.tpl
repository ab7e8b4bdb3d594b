{{/*
KV hand-off configuration, built as data and rendered with toJson/toYaml, never pasted into strings.

Protocol facts checked against (see ../shared/design/pd-protocols.md):
- LMCache PD keys, types and the ProxyNotif flow: lmcache 0.5.6 (lmcache/v1/config.py, the
  pd_backend): ports are lists of ints indexed by TP rank, pd_buffer_size is bytes per worker.
  Retired keys (enable_nixl, nixl_role, nixl_receiver_host, nixl_receiver_port) are only logged as
  unknown by LMCache, so they are never rendered and tests/ check every key against 0.5.6's list.
  save_unfull_chunk is rendered true: LMCache 0.5.6 forces it for enable_pd (with a warning on
  every start) because a dropped partial last chunk would leave the decoder with incomplete KV.
- kv-transfer-config shapes (LMCacheConnectorV1, NixlConnector with top-level
  kv_load_failure_policy, kv_buffer_device and kv_connector_extra_config.backends): vLLM 0.31.0
  and 0.33.0 (KVTransferConfig; tests/engines/ parses every rendered one with both, and
  tests/real_engine/ serves the dev environment's with vLLM 0.31.0's CPU build).
*/}}

{{/* --kv-transfer-config for a role, as JSON. Call with (dict "ctx" $ "role" "prefill"). */}}
{{- define "pd-inference.kvTransferConfig" -}}
{{- $v := .ctx.Values -}}
{{- $cfg := dict -}}
{{- if eq $v.kvTransfer.connector "lmcache" -}}
{{- $extra := dict "discard_partial_chunks" false -}}
{{- if eq .role "prefill" -}}
{{- $_ := set $extra "lmcache_rpc_port" "producer1" -}}
{{- $cfg = dict "kv_connector" "LMCacheConnectorV1" "kv_role" "kv_producer" "kv_connector_extra_config" $extra -}}
{{- else -}}
{{- $_ := set $extra "lmcache_rpc_port" "consumer1" -}}
{{- $_ := set $extra "skip_last_n_tokens" 1 -}}
{{- $cfg = dict "kv_connector" "LMCacheConnectorV1" "kv_role" "kv_consumer" "kv_connector_extra_config" $extra -}}
{{- end -}}
{{- else -}}
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
{{- $cfg = dict "kv_connector" "NixlConnector" "kv_role" $role "kv_load_failure_policy" $v.kvTransfer.nixl.loadFailurePolicy "kv_buffer_device" $v.kvTransfer.nixl.bufferDevice "kv_connector_extra_config" $extra -}}
{{- end -}}
{{- toJson $cfg -}}
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
