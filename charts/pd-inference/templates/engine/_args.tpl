{{/*
What the chart puts on an engine's command line and in its environment. One source: the
StatefulSet renders these, and templates/_validate.tpl refuses extraArgs and env that repeat
them (a repeated flag or variable would silently override the chart's own). Call with
(dict "ctx" $ "role" "prefill").
*/}}

{{- define "pd-inference.engineArgs" -}}
{{- $v := .ctx.Values -}}
{{- $r := get $v .role -}}
- {{ $v.model.name | quote }}
- --host=0.0.0.0
- --port={{ include "pd-inference.port" (dict "ctx" .ctx "component" .role "name" "http") }}
{{- /* the served name, then its KV revision's (engine/_revision.tpl): vLLM accepts both,
answers with the first, and refuses a hand-off leg named for another revision */}}
- --served-model-name
- {{ $v.model.servedName | quote }}
- {{ include "pd-inference.kvRevisionName" .ctx | quote }}
{{- with $v.model.revision }}
- --revision={{ . }}
{{- end }}
- --tensor-parallel-size={{ int $r.tensorParallelSize }}
- --max-model-len={{ int $v.model.maxModelLen }}
- --gpu-memory-utilization={{ $r.gpuMemoryUtilization }}
{{- /* On SIGTERM (after the preStop wait) finish what is in flight within drainSeconds; vLLM 0.31.0
and 0.33.0 default to 0, which aborts it (v1/engine/core.py _handle_shutdown: "abort" mode; >0
"drain" keeps the engine up while scheduler.has_requests(), NIXL KV not yet read included). */}}
- --shutdown-timeout={{ int $r.drainSeconds }}
{{- with $v.model.reasoningParser }}
- --reasoning-parser={{ . }}
{{- end }}
{{- with $v.model.toolCallParser }}
- --enable-auto-tool-choice
- --tool-call-parser={{ . }}
{{- end }}
{{- include "pd-inference.engine.loraArgs" .ctx }}
- --kv-transfer-config
- {{ include "pd-inference.kvTransferConfig" (dict "ctx" .ctx "role" .role) | toJson }}
{{- if $v.engine.kvEvents.enabled }}
{{- /* KV-cache events for the router's prefix index (engine.kvEvents). No
--prefix-caching-hash-algo check or pin: the router indexes the token ids the events carry, not
vLLM's block hashes, so any hash algorithm serves it. */}}
- --kv-events-config
- {{ include "pd-inference.kvEventsConfig" (dict "ctx" .ctx "role" .role) | toJson }}
{{- end }}
{{- with include "pd-inference.tracing.engineArgs" .ctx }}
{{ . }}
{{- end }}
{{- include "pd-inference.engine.parallelArgs" . }}
{{- end -}}

{{/*
Data, expert and multi-node parallelism (vLLM 0.31.0 / 0.33.0, engine/arg_utils.py
create_engine_config): one engine of <role>.nodes pods, vLLM's own multiprocessing launcher, no
Ray. Every pod runs `vllm serve` with --nnodes and its --node-rank; the leader (rank 0, the
LeaderWorkerSet's leader) serves the API, the others run --headless. --master-addr is the
leader's stable DNS name, which LeaderWorkerSet's pod webhook puts in LWS_LEADER_ADDRESS, and
--node-rank a worker's LWS_WORKER_INDEX (1..nodes-1); Kubernetes expands both $(VAR)s from the
container's env. vLLM infers each node's data-parallel ranks from --nnodes and --node-rank
(world size tensorParallelSize x dataParallelSize split evenly over the nodes) and uses
--master-addr as the data-parallel address. Nothing for a one-node engine of one DP rank.
*/}}
{{- define "pd-inference.engine.parallelArgs" -}}
{{- $r := get .ctx.Values .role -}}
{{- $nodes := int ($r.nodes | default 1) -}}
{{- $worker := eq (.member | default "single") "worker" -}}
{{- if gt (int ($r.dataParallelSize | default 1)) 1 }}
- --data-parallel-size={{ int $r.dataParallelSize }}
{{- end }}
{{- if $r.expertParallel }}
- --enable-expert-parallel
{{- end }}
{{- if gt $nodes 1 }}
- --nnodes={{ $nodes }}
- --node-rank={{ ternary "$(LWS_WORKER_INDEX)" "0" $worker }}
- --master-addr=$(LWS_LEADER_ADDRESS)
{{- if $worker }}
- --headless
{{- end }}
{{- end }}
{{- end -}}

{{/*
vLLM's --kv-events-config (KVEventsConfig, vLLM 0.31.0 / 0.33.0): compact JSON, keys in this
order. The engine binds both sockets on every interface; the router connects to each pod's IP.
Call with (dict "ctx" $ "role" "prefill").
*/}}
{{- define "pd-inference.kvEventsConfig" -}}
{{- $events := include "pd-inference.port" (dict "ctx" .ctx "component" .role "name" "kv-events" "kvEvents" true) -}}
{{- $replay := include "pd-inference.port" (dict "ctx" .ctx "component" .role "name" "kv-replay" "kvEvents" true) -}}
{{- printf "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":%s,\"replay_endpoint\":%s,\"topic\":%s}" (printf "tcp://*:%s" $events | toJson) (printf "tcp://*:%s" $replay | toJson) (include "pd-inference.kvEventsTopic" . | toJson) -}}
{{- end -}}

{{/* The ZMQ topic the engines publish their KV-cache events under, and the router subscribes to. */}}
{{- define "pd-inference.kvEventsTopic" -}}kv{{- end -}}

{{- define "pd-inference.engineEnv" -}}
{{- $v := .ctx.Values -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
# Both roles must hash prompt chunks identically (LMCache chunk keys, vLLM prefix blocks).
- name: PYTHONHASHSEED
  value: "0"
- name: HF_HOME
  value: {{ printf "%s/hf" $v.modelCache.mountPath | quote }}
{{ include "pd-inference.engine.cacheEnv" . }}
- name: VLLM_CACHE_ROOT
  value: /tmp/cache/vllm
{{- if $v.model.hfTokenSecret.name }}
# The token stays a file (huggingface_hub reads HF_TOKEN_PATH), not an env var that
# every child process and crash dump would carry.
- name: HF_TOKEN_PATH
  value: {{ include "pd-inference.hfTokenFile" .ctx }}
{{- end }}
{{- with $v.model.hubEndpoint }}
- name: HF_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- /* The connector's own (templates/_connectors.tpl). */}}
{{- with include (printf "pd-inference.connectors.%s.env" $v.kvTransfer.connector) . }}
{{ . }}
{{- end }}
{{- if gt (int ((get $v .role).nodes | default 1)) 1 }}
# A multi-node engine: torch.distributed and vLLM's data-parallel sockets between the group's pods
# bind and advertise this pod's IP (vLLM picks one itself otherwise, maybe not the pod network's).
- name: VLLM_HOST_IP
  value: $(POD_IP)
{{- end }}
{{- if $v.efa.enabled }}
- name: FI_PROVIDER
  value: efa
{{- end }}
{{- with include "pd-inference.tracing.engineEnv" . }}
{{ . }}
{{- end }}
{{- end -}}


{{/*
LoRA adapters (model.lora), the same on both roles: a prefiller and a decoder must both hold an
adapter for its KV to be usable (vLLM 0.31.0 hashes every block of an adapter's request with the
adapter's name and path: v1/core/kv_cache_utils.py _gen_lora_extra_hash_keys; NixlConnector
itself never looks at the adapter: a decode leg named for another model answers 200 with wrong
tokens). Static --lora-modules, loaded at start (entrypoints/openai/models/serving.py
init_static_loras; one that fails to load stops the engine), rather than vLLM's runtime
/v1/load_lora_adapter, which needs VLLM_ALLOW_RUNTIME_LORA_UPDATING and is lost on a restart:
the adapters a pod serves are what git says (docs/lora.md). Each module as JSON, with the served
name as its base, so that /v1/models lists it with that `parent` (a `name=path` item with a comma
in the path would be read as JSON: cli_args.py LoRAParserAction). --max-lora-rank takes only
vLLM's MaxLoRARanks (config/lora.py): the smallest at or above the largest adapter's rank.
*/}}
{{- define "pd-inference.engine.loraArgs" -}}
{{- $v := .Values -}}
{{- $l := $v.model.lora -}}
{{- with $l.adapters }}
- --enable-lora
- --max-loras={{ int $l.maxLoras }}
- --max-cpu-loras={{ int ($l.maxCpuLoras | default (len .)) }}
- --max-lora-rank={{ include "pd-inference.loraMaxRank" $v }}
- --lora-modules
{{- range . }}
- {{ dict "name" .name "path" (include "pd-inference.loraPath" (dict "ctx" $ "adapter" .)) "base_model_name" $v.model.servedName | toJson | toJson }}
{{- end }}
{{- end }}
{{- end -}}

{{/* vLLM's --max-lora-rank for model.lora.adapters: the smallest of its MaxLoRARanks (vLLM
0.31.0 config/lora.py) at or above every adapter's rank (the schema caps a rank at 512). */}}
{{- define "pd-inference.loraMaxRank" -}}
{{- $top := 1 -}}
{{- range .model.lora.adapters -}}{{- $top = max $top (int .rank) -}}{{- end -}}
{{- $found := 0 -}}
{{- range list 1 8 16 32 64 128 256 320 512 -}}
{{- if and (not $found) (ge . $top) -}}{{- $found = . -}}{{- end -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{/* Where an engine reads an adapter: its `path`, or for a `hub` source the snapshot folder
huggingface_hub makes for that commit in the model cache (HF_HOME/hub/models--<org>--<name>/
snapshots/<commit>), which the engine preflight downloads before vLLM starts. */}}
{{- define "pd-inference.loraPath" -}}
{{- $a := .adapter -}}
{{- if $a.hub -}}
{{- printf "%s/hf/hub/models--%s/snapshots/%s" .ctx.Values.modelCache.mountPath (replace "/" "--" $a.hub.id) $a.hub.revision -}}
{{- else -}}
{{- $a.path -}}
{{- end -}}
{{- end -}}

{{/* The adapters' names (model.lora.adapters), as a JSON list: the router's model.adapters. */}}
{{- define "pd-inference.loraNames" -}}
{{- $names := list -}}
{{- range .Values.model.lora.adapters -}}{{- $names = append $names .name -}}{{- end -}}
{{- $names | toJson -}}
{{- end -}}

{{/* Where an engine image's programs keep their caches: the root filesystem is read-only (torch.compile, Triton, vLLM, numba's compiled functions: LMCache 0.5.6 imports numba functions cached to disk), so /tmp. The vllm and lmcache-server containers alike. */}}
{{- define "pd-inference.engine.cacheEnv" -}}
- name: HOME
  value: /tmp/home
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: NUMBA_CACHE_DIR
  value: /tmp/cache/numba
{{- end -}}
