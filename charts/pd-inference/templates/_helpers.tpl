{{/* Names ---------------------------------------------------------------- */}}

{{- define "pd-inference.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name prefix. Truncated to 45 characters so that "<fullname>-prefill-<ordinal>" and the
StatefulSet controller-revision-hash label stay within Kubernetes' 63-character label limit.
*/}}
{{- define "pd-inference.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "<fullname>-<component>", the name of every object of a component. Call with (dict "ctx" $ "component" "router"). */}}
{{- define "pd-inference.componentName" -}}
{{- printf "%s-%s" (include "pd-inference.fullname" .ctx) .component -}}
{{- end -}}

{{/* FQDN of a component's Service. */}}
{{- define "pd-inference.serviceFqdn" -}}
{{- printf "%s.%s.svc.%s" (include "pd-inference.componentName" .) .ctx.Release.Namespace .ctx.Values.clusterDomain -}}
{{- end -}}

{{- define "pd-inference.routerServiceAccountName" -}}
{{- if .Values.router.serviceAccount.create -}}
{{- default (include "pd-inference.componentName" (dict "ctx" . "component" "router")) .Values.router.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.router.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.engineServiceAccountName" -}}
{{- if .Values.engine.serviceAccount.create -}}
{{- default (include "pd-inference.componentName" (dict "ctx" . "component" "engine")) .Values.engine.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.engine.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels ---------------------------------------------------------------- */}}

{{/* Selector labels: only the immutable subset (a StatefulSet/Deployment selector cannot change). */}}
{{- define "pd-inference.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pd-inference.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pd-inference.labels" -}}
{{ include "pd-inference.podLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
helm.sh/chart: {{ include "pd-inference.chart" .ctx }}
{{- end -}}

{{/*
The labels of a pod template: the standard set without the chart's and the router's version.
Those two change with every chart release; in a pod template they would replace every pod of
every release (each engine reloading its model) for a change that touched nothing it runs.
They stay on the objects' own metadata (pd-inference.labels).
*/}}
{{- define "pd-inference.podLabels" -}}
{{ include "pd-inference.selectorLabels" . }}
app.kubernetes.io/part-of: pd-inference
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Images: a digest wins over a tag. Call with (dict "image" .Values.x "default" "tag"). */}}
{{- define "pd-inference.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .default .image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The engine pods' helper containers' image (engine.helperImage): the router's program, pinned
apart from router.image so that a router release leaves the engines' pod templates alone. */}}
{{- define "pd-inference.helperImage" -}}
{{- $h := .Values.engine.helperImage -}}
{{- $image := dict "repository" (default .Values.router.image.repository $h.repository) "tag" $h.tag "digest" $h.digest -}}
{{- include "pd-inference.image" (dict "image" $image "default" .Chart.AppVersion) -}}
{{- end -}}

{{/* Ports: templates/_ports.tpl. */}}

{{/* "true" when every engine takes either part (engine.layout flexible), else "". */}}
{{- define "pd-inference.flexible" -}}
{{- if eq .Values.engine.layout "flexible" -}}true{{- end -}}
{{- end -}}

{{/*
The engine roles this release runs, as a JSON list, in the order the objects render: every
per-role template (StatefulSets, LeaderWorkerSets, Services, ConfigMaps, PDBs, autoscalers,
NetworkPolicies and their peers, the PodMonitor, the KV revision, the zone affinity, the checks)
ranges over it, so the layout's rule lives here alone. split: prefill and decode. flexible:
decode alone, each engine of it a decode engine that also prefills for another
(templates/_connectors.tpl kv_both). Use: range $role := include "pd-inference.engineRoles" $ | fromJsonArray
*/}}
{{- define "pd-inference.engineRoles" -}}
{{- if include "pd-inference.flexible" . -}}
{{- list "decode" | toJson -}}
{{- else -}}
{{- list "prefill" "decode" | toJson -}}
{{- end -}}
{{- end -}}

{{/* The NIXL backend: LIBFABRIC on EFA, UCX otherwise, unless set explicitly. */}}
{{- define "pd-inference.nixlBackend" -}}
{{- if ne .Values.kvTransfer.backend "auto" -}}
{{- .Values.kvTransfer.backend -}}
{{- else if .Values.efa.enabled -}}
LIBFABRIC
{{- else -}}
UCX
{{- end -}}
{{- end -}}

{{/* Where engine containers find files/preflight.py (engine.preflight). */}}
{{- define "pd-inference.preflightDir" -}}/etc/pd-inference{{- end -}}

{{/*
"true" when model.name names a model family vLLM serves as a hybrid (IsHybrid or attention-free:
linear-attention, Gated DeltaNet, KDA or Mamba layers, more than one KV-cache group). Families of
the IsHybrid architectures in vLLM 0.31.0 / 0.33.0 (model_executor/models/registry.py and
vllm/models/): Qwen3.5 (and 3.6, 3.8), Qwen3-Next, Qwen4-Exp, Jamba, Mamba/Mamba2 (Falcon-Mamba,
Codestral Mamba), Falcon-H1, Granite 4.0-H and 4.0-Tiny (GraniteMoeHybrid), Nemotron-H (Nemotron
Nano v2, Nemotron 3 Nano/Super/Ultra), Zamba2, LFM2, Kimi-Linear, Kimi-K3, GLM-5-Next,
MiniCPM-V 4.6, OLMo-Hybrid, Ling/Ring linear and 2.5/3 (BailingMoe V2.5/V3). Matched
case-insensitively on the last path segment, so /models/Qwen3.5-9B matches and
/models/mamba-team/llama-3-8b does not. A miss only matters for the LMCache refusal; declare
model.attention for a name this list does not know.
*/}}
{{- define "pd-inference.hybridFamily" -}}
{{- $families := list "qwen3[.][5-9]" "qwen3-next" "qwen4" "jamba" "mamba" "falcon-h1" "granite-4[.][0-9]+-(h|tiny)" "nemotron-h" "nemotron-nano-[0-9.]+b-v2" "nemotron-3-(nano|super|ultra)" "zamba" "lfm2" "kimi-linear" "kimi-k3" "glm-?5-next" "minicpm-v-?4[._]6" "olmo-hybrid" "(ling|ring)-[a-z0-9.-]*(linear|2[.]5)" "(ling|ring)-3" -}}
{{- if regexMatch (printf "(?i)(%s)" (join "|" $families)) (base .Values.model.name) -}}true{{- end -}}
{{- end -}}

{{/* "true" when the engine pods run LMCache's MP server beside the NIXL hand-off (kvTransfer.nixl.lmcacheMp; validate/_handoff.tpl refuses it on another connector). */}}
{{- define "pd-inference.lmcacheMp" -}}
{{- if and .Values.kvTransfer.nixl.lmcacheMp.enabled (eq .Values.kvTransfer.connector "nixl") -}}true{{- end -}}
{{- end -}}

{{/* "true" when the model is hybrid: declared by model.attention, else known by its name. */}}
{{- define "pd-inference.hybridModel" -}}
{{- if eq .Values.model.attention "hybrid" -}}true
{{- else if and (eq .Values.model.attention "") (eq (include "pd-inference.hybridFamily" .) "true") -}}true
{{- end -}}
{{- end -}}

{{/*
GPUs and EFA interfaces of the EC2 instance types an engine pod may be pinned to
(prefill/decode.instanceType), for the placement checks in _validate.tpl: a pod asking for more
than its instance type has would stay Pending forever. From Karpenter's generated instance-type
reference (nvidia.com/gpu, vpc.amazonaws.com/efa = EfaInfo.MaximumEfaInterfaces; 0 = no EFA),
checked 2026-12. A type not listed here is not checked: the scheduler reports it instead.
*/}}
{{- define "pd-inference.instanceTypes" -}}
p4d.24xlarge: {gpus: 8, efa: 4}
p4de.24xlarge: {gpus: 8, efa: 4}
p5.4xlarge: {gpus: 1, efa: 1}
p5.48xlarge: {gpus: 8, efa: 32}
p5e.48xlarge: {gpus: 8, efa: 32}
p5en.48xlarge: {gpus: 8, efa: 16}
p6-b200.48xlarge: {gpus: 8, efa: 8}
p6-b300.48xlarge: {gpus: 8, efa: 16}
{{- range $family := list "g5" "g6" }}
{{ $family }}.xlarge: {gpus: 1, efa: 0}
{{ $family }}.2xlarge: {gpus: 1, efa: 0}
{{ $family }}.4xlarge: {gpus: 1, efa: 0}
{{ $family }}.8xlarge: {gpus: 1, efa: 1}
{{ $family }}.12xlarge: {gpus: 4, efa: 1}
{{ $family }}.16xlarge: {gpus: 1, efa: 1}
{{ $family }}.24xlarge: {gpus: 4, efa: 1}
{{ $family }}.48xlarge: {gpus: 8, efa: 1}
{{- end }}
g6e.xlarge: {gpus: 1, efa: 0}
g6e.2xlarge: {gpus: 1, efa: 0}
g6e.4xlarge: {gpus: 1, efa: 0}
g6e.8xlarge: {gpus: 1, efa: 1}
g6e.12xlarge: {gpus: 4, efa: 1}
g6e.16xlarge: {gpus: 1, efa: 1}
g6e.24xlarge: {gpus: 4, efa: 2}
g6e.48xlarge: {gpus: 8, efa: 4}
g7e.2xlarge: {gpus: 1, efa: 0}
g7e.4xlarge: {gpus: 1, efa: 0}
g7e.8xlarge: {gpus: 1, efa: 1}
g7e.12xlarge: {gpus: 2, efa: 1}
g7e.24xlarge: {gpus: 4, efa: 2}
g7e.48xlarge: {gpus: 8, efa: 4}
{{- end -}}

{{/* Replicas that run at least: minReplicas under autoscaling, else replicas. Call with the component's values. */}}
{{- define "pd-inference.minReplicas" -}}
{{- if and .autoscaling .autoscaling.enabled -}}
{{- .autoscaling.minReplicas -}}
{{- else -}}
{{- .replicas -}}
{{- end -}}
{{- end -}}

{{/*
The pod-spec fields a role's values name as they are, each rendered only when set (empty = the
cluster's default): priorityClassName, runtimeClassName, schedulerName. Call with the role's values
(.Values.prefill, .Values.decode, .Values.router); the schema checks each as Kubernetes does (the
class names as DNS subdomains; the scheduler name not at all, so it is quoted).
*/}}
{{- define "pd-inference.podScheduling" -}}
{{- range $field := list "priorityClassName" "runtimeClassName" "schedulerName" -}}
{{- with get $ $field }}
{{ $field }}: {{ . | quote }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The x-pd-reason values an answer to a single request may carry under this release's
router.decision, as a JSON list (the helm test checks them): the decision's own reasons, then
the fallbacks' (pd_router.metrics DECIDED and FALLBACK_REASONS; tests/test_helm_test_pod.py
checks the two agree; batch is left out: the test sends single requests).
*/}}
{{- define "pd-inference.routeReasons" -}}
{{- $decided := list "below_threshold" "prefix_cached" "prefill_busy" "always" "above_threshold" -}}
{{- if eq .Values.router.decision "goodput" -}}
{{- $decided = list "handoff_not_worth" "whole_best" "one_engine_enough" "split_protects_itl" "split_faster" -}}
{{- end -}}
{{- $fallbacks := list "unsupported_fields" "no_prefiller" "prefill_error" "prefill_timeout" "no_kv_params" "tokenize_error" "unknown_max_tokens" "notify_timeout" "decode_retry" "too_long" "reasoning_parser" "prefill_refused" "no_revision_pair" "weights_differ" "handoff_failing" "no_adapter_pair" -}}
{{- concat $decided $fallbacks | toJson -}}
{{- end -}}

{{/* "true" when the router itself receives the prefillers' KV-landed notifications (and so must be a single replica). */}}
{{- define "pd-inference.routerReceivesNotifications" -}}
{{- if and (include "pd-inference.connector" . | fromJson).notifications (eq .Values.kvTransfer.lmcache.notificationReceiver "router") -}}true{{- end -}}
{{- end -}}

{{/* "true" when every prefill pod runs the notification sidecar (it receives the prefiller's KV-landed notifications). */}}
{{- define "pd-inference.notificationSidecar" -}}
{{- if and (include "pd-inference.connector" . | fromJson).notifications (eq .Values.kvTransfer.lmcache.notificationReceiver "prefillSidecar") -}}true{{- end -}}
{{- end -}}

{{/*
Where a pod finds the Hugging Face token (model.hfTokenSecret): a mounted file, read through
HF_TOKEN_PATH by the engines and through model.tokenizerHub.tokenFile by the router.
*/}}
{{- define "pd-inference.hfTokenDir" -}}/var/run/secrets/huggingface{{- end -}}
{{- define "pd-inference.hfTokenFileName" -}}token{{- end -}}
{{- define "pd-inference.hfTokenFile" -}}{{ include "pd-inference.hfTokenDir" . }}/{{ include "pd-inference.hfTokenFileName" . }}{{- end -}}
{{- define "pd-inference.defaultHubEndpoint" -}}https://huggingface.co{{- end -}}

{{/* True when the router pod needs the Hugging Face token (it fetches the tokenizer with it). */}}
{{- define "pd-inference.routerNeedsHfToken" -}}
{{- if and .Values.model.routerTokenizerFromHub .Values.model.hfTokenSecret.name -}}true{{- end -}}
{{- end -}}

{{/*
The router's start-up budget: its startupProbe allows periodSeconds x failureThreshold before
/health must answer, and the one-time tokenizer fetch (before the port opens) gets half of it.
*/}}
{{- define "pd-inference.routerStartupPeriodSeconds" -}}2{{- end -}}
{{- define "pd-inference.routerStartupFailureThreshold" -}}30{{- end -}}
{{- define "pd-inference.routerTokenizerFetchSeconds" -}}
{{- div (mul (include "pd-inference.routerStartupPeriodSeconds" . | int) (include "pd-inference.routerStartupFailureThreshold" . | int)) 2 -}}
{{- end -}}

{{/* A Kubernetes quantity as a plain number (bytes, cores), for comparisons. */}}
{{- define "pd-inference.quantity" -}}
{{- $q := toString . -}}
{{- $units := dict "n" 1e-9 "u" 1e-6 "m" 1e-3 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- $suffix := regexFind "([numkMGTPE]|[KMGTPE]i)$" $q -}}
{{- $num := trimSuffix $suffix $q | float64 -}}
{{- mulf $num (get $units $suffix | default 1.0) -}}
{{- end -}}

{{/* Egress to the cluster DNS (networkPolicy.egress.dnsTo), UDP and TCP 53. */}}
{{- define "pd-inference.dnsEgress" -}}
- to:
    {{- toYaml .Values.networkPolicy.egress.dnsTo | nindent 4 }}
  ports:
    - port: 53
      protocol: UDP
    - port: 53
      protocol: TCP
{{- end -}}
