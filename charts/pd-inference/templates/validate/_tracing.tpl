{{/* Tracing: what its schema cannot say. Included by pd-inference.validate (templates/_validate.tpl), in its order. */}}

{{- define "pd-inference.validate.tracing" -}}
{{- $v := .Values -}}
{{- /* Tracing (templates/_tracing.tpl): what its schema cannot say. */ -}}
{{- $t := $v.tracing -}}
{{- if and $t.endpoint (eq $t.protocol "grpc") (not (regexMatch "^https?://[^/?#]+/?$" $t.endpoint)) -}}
{{- fail (printf "tracing.endpoint: %s has a path, which gRPC cannot use: give http(s)://host:port, or set tracing.protocol: http/protobuf for a base URL with a path" $t.endpoint) -}}
{{- end -}}
{{- /* vLLM 0.31.0 and 0.33.0 build their gRPC exporter with insecure=True whatever the scheme
(vllm/tracing/otel.py get_span_exporter), so an https:// gRPC endpoint would get plaintext. */ -}}
{{- if and (include "pd-inference.tracing.engines" .) (eq $t.protocol "grpc") (hasPrefix "https://" $t.endpoint) -}}
{{- fail (printf "tracing.endpoint: %s is TLS, but vLLM (%s) exports over gRPC in plaintext whatever the scheme; use tracing.protocol: http/protobuf for a TLS collector, or tracing.engines.enabled: false to trace the router only" $t.endpoint (index .Chart.Annotations "pd-inference.io/checked-vllm" | replace "," ", ")) -}}
{{- end -}}
{{- if and $t.engines.detailedTraces (not (include "pd-inference.tracing.engines" .)) -}}
{{- fail (printf "tracing.engines.detailedTraces: %s needs the engines' traces: set tracing.endpoint and tracing.engines.enabled, or leave it empty" $t.engines.detailedTraces) -}}
{{- end -}}
{{- if and (include "pd-inference.tracing.on" .) $v.networkPolicy.enabled $v.networkPolicy.egress.enabled (not $v.networkPolicy.egress.tracingTo) -}}
{{- fail (printf "networkPolicy.egress.tracingTo: tracing.endpoint %s is set and the egress policies are on, but no peer may receive the spans; name where the collector runs (e.g. its namespace), or turn tracing off" $t.endpoint) -}}
{{- end -}}
{{- end -}}
