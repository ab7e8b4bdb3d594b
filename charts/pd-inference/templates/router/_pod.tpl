{{/*
The computed fragments of the router pod: what the chart adds to the user's values.
*/}}

{{/*
Affinity: router.affinity plus, with router.antiAffinity, a pod anti-affinity on the node to this
release's router pods, selected by the chart's selector labels (so another release's routers,
which share the component label, neither repel these nor are repelled). Empty when none.
*/}}
{{- define "pd-inference.router.affinity" -}}
{{- $r := .Values.router -}}
{{- $affinity := deepCopy ($r.affinity | default dict) -}}
{{- if ne $r.antiAffinity "none" -}}
{{- $selector := include "pd-inference.selectorLabels" (dict "ctx" . "component" "router") | fromYaml -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" $selector) -}}
{{- $anti := get $affinity "podAntiAffinity" | default dict -}}
{{- if eq $r.antiAffinity "required" -}}
{{- $_ := set $anti "requiredDuringSchedulingIgnoredDuringExecution" (append (get $anti "requiredDuringSchedulingIgnoredDuringExecution" | default list) $term) -}}
{{- else -}}
{{- $_ := set $anti "preferredDuringSchedulingIgnoredDuringExecution" (append (get $anti "preferredDuringSchedulingIgnoredDuringExecution" | default list) (dict "weight" 100 "podAffinityTerm" $term)) -}}
{{- end -}}
{{- $_ := set $affinity "podAntiAffinity" $anti -}}
{{- end -}}
{{- with $affinity -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}
