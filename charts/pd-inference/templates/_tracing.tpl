{{/*
OpenTelemetry traces (values `tracing`): what the router's config, the engines' flags and env,
and the NetworkPolicies take from them. Off (empty endpoint) renders nothing here, so turning
tracing on or off touches no pod that does not trace.
*/}}

{{/* "true" when the router traces (tracing.endpoint set), else "". */}}
{{- define "pd-inference.tracing.on" -}}
{{- if .Values.tracing.endpoint -}}true{{- end -}}
{{- end -}}

{{/* "true" when the engines export vLLM's spans too, else "". */}}
{{- define "pd-inference.tracing.engines" -}}
{{- if and .Values.tracing.endpoint .Values.tracing.engines.enabled -}}true{{- end -}}
{{- end -}}

{{/*
The URL vLLM's --otlp-traces-endpoint takes: its OpenTelemetry SDK gives it to the exporter as
is (vllm/tracing.py get_span_exporter, 0.31.0), so for http/protobuf the signal path is added
here, as the SDK adds it to OTEL_EXPORTER_OTLP_ENDPOINT (and the router to its own endpoint:
pd_router.tracing.TRACES_PATH; tests/test_tracing_values.py checks the two agree).
*/}}
{{- define "pd-inference.tracing.signalUrl" -}}
{{- $t := .Values.tracing -}}
{{- if eq $t.protocol "grpc" -}}
{{- $t.endpoint -}}
{{- else -}}
{{- printf "%s/v1/traces" (trimSuffix "/" $t.endpoint) -}}
{{- end -}}
{{- end -}}

{{/* The endpoint's port: written in it, else its scheme's (443, 80). */}}
{{- define "pd-inference.tracing.port" -}}
{{- $rest := regexReplaceAll "^https?://" .Values.tracing.endpoint "" -}}
{{- $hostport := first (splitList "/" $rest) -}}
{{- $port := regexFind ":[0-9]+$" $hostport -}}
{{- if $port -}}
{{- trimPrefix ":" $port -}}
{{- else -}}
{{- ternary "443" "80" (hasPrefix "https://" .Values.tracing.endpoint) -}}
{{- end -}}
{{- end -}}

{{/* An egress rule to the collector (networkPolicy.egress.tracingTo), or nothing. */}}
{{- define "pd-inference.tracing.egress" -}}
{{- if include "pd-inference.tracing.on" . -}}
# The OpenTelemetry collector (tracing.endpoint).
- to:
    {{- toYaml .Values.networkPolicy.egress.tracingTo | nindent 4 }}
  ports:
    - port: {{ include "pd-inference.tracing.port" . }}
      protocol: TCP
{{- end -}}
{{- end -}}

{{- define "pd-inference.tracing.headersDir" -}}/etc/pd-router/otlp-headers{{- end -}}

{{/*
The engines' OpenTelemetry environment, read by the SDK vLLM builds its exporter with: the
service and pod they are, the protocol, the sampler (parent-based, so a request through the
router is traced exactly when the router traces it; the ratio for one that comes straight in),
the headers from the Secret. Call with (dict "ctx" $ "role" "prefill").
*/}}
{{- define "pd-inference.tracing.engineEnv" -}}
{{- $v := .ctx.Values -}}
{{- if include "pd-inference.tracing.engines" .ctx -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_SERVICE_NAME
  value: {{ include "pd-inference.componentName" (dict "ctx" .ctx "component" .role) | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=%s,k8s.pod.name=$(POD_NAME),k8s.statefulset.name=%s" .ctx.Release.Namespace (include "pd-inference.componentName" (dict "ctx" .ctx "component" .role)) | quote }}
- name: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
  value: {{ $v.tracing.protocol | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $v.tracing.samplingRatio | toString | quote }}
{{- with $v.tracing.headersSecret.name }}
- name: OTEL_EXPORTER_OTLP_TRACES_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $v.tracing.headersSecret.key }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The engines' vLLM flags. Call with the root context. */}}
{{- define "pd-inference.tracing.engineArgs" -}}
{{- if include "pd-inference.tracing.engines" . -}}
- --otlp-traces-endpoint={{ include "pd-inference.tracing.signalUrl" . }}
{{- with .Values.tracing.engines.detailedTraces }}
- --collect-detailed-traces={{ . }}
{{- end }}
{{- end -}}
{{- end -}}
