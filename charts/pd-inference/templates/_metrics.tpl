{{/*
Metrics: the labels every scraped series carries, the PromQL selector built from them, and the
gate of every custom resource. The label names are defined here once; the monitors' relabelings,
the autoscalers' queries, the PrometheusRule and the dashboard (files/dashboards/, checked by
tests/observability) all select on them.
*/}}

{{- define "pd-inference.metricsComponentLabel" -}}component{{- end -}}
{{- define "pd-inference.metricsReleaseLabel" -}}release{{- end -}}

{{/*
Relabelings for a PodMonitor ("pod") or ServiceMonitor ("service"): copy the component and the
release from the Kubernetes labels the chart sets. The Prometheus Operator already adds
`namespace`, `pod`, `container`, `service`, `endpoint` and `job` (prometheus-operator v0.93.0,
pkg/prometheus/promcfg.go). Call with (dict "role" "pod").
*/}}
{{- define "pd-inference.metricsRelabelings" -}}
- sourceLabels: [__meta_kubernetes_{{ .role }}_label_app_kubernetes_io_component]
  targetLabel: {{ include "pd-inference.metricsComponentLabel" . }}
- sourceLabels: [__meta_kubernetes_{{ .role }}_label_app_kubernetes_io_instance]
  targetLabel: {{ include "pd-inference.metricsReleaseLabel" . }}
{{- end -}}

{{/* PromQL label matchers for this release's series; with "component", one component's. Call with (dict "ctx" $ "component" "decode"). */}}
{{- define "pd-inference.metricsSelector" -}}
namespace="{{ .ctx.Release.Namespace }}",{{ include "pd-inference.metricsReleaseLabel" . }}="{{ .ctx.Release.Name }}"
{{- with .component }},{{ include "pd-inference.metricsComponentLabel" $ }}="{{ . }}"{{ end -}}
{{- end -}}

{{/*
Whether to render an enabled custom resource: "true" when Helm reports its API (Argo CD and
`helm install` pass the cluster's; `make render` passes those of ci/crds/) or
`crds.assumeInstalled` is set. An enabled one whose API is missing stops the render naming the
value, so a missing Prometheus Operator or KEDA is never a silently dropped object.
Call with (dict "ctx" $ "api" "monitoring.coreos.com/v1/ServiceMonitor" "field" "metrics.serviceMonitor.enabled").
*/}}
{{- define "pd-inference.renderCustomResource" -}}
{{- if or .ctx.Values.crds.assumeInstalled (.ctx.Capabilities.APIVersions.Has .api) -}}
true
{{- else -}}
{{- fail (printf "%s: the cluster does not serve %s (install its CRDs first), or Helm was not told it does: pass --api-versions %s to helm template, or set crds.assumeInstalled: true where the chart is rendered without cluster access" .field .api .api) -}}
{{- end -}}
{{- end -}}

{{/* The engines' queue depth, what autoscaling follows (vLLM 0.31.0 and 0.33.0, v1/metrics/loggers.py). */}}
{{- define "pd-inference.queueMetric" -}}vllm:num_requests_waiting{{- end -}}
