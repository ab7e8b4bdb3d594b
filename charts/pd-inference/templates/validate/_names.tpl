{{/* Names, label and annotation keys, the labels the chart owns. Included by pd-inference.validate (templates/_validate.tpl), in its order. */}}

{{- define "pd-inference.validate.names" -}}
{{- $v := .Values -}}
{{- /* Names: "<fullname>-prefill" is a StatefulSet whose pods carry the label
controller-revision-hash "<name>-<10-character hash>", at most 63 characters, so the fullname may
have at most 44 (a longer one used to be cut, and the prefill pods then never got created). */ -}}
{{- $full := $v.fullnameOverride | default (ternary .Release.Name (printf "%s-%s" .Release.Name (default .Chart.Name $v.nameOverride)) (contains (default .Chart.Name $v.nameOverride) .Release.Name)) -}}
{{- if gt (len $full) 44 -}}
{{- $field := ternary "fullnameOverride" "the release name (or set fullnameOverride)" (not (empty $v.fullnameOverride)) -}}
{{- fail (printf "%s: the objects' name prefix %q has %d characters; at most 44 fit (the StatefulSet <name>-prefill and its pods' controller-revision-hash label of <statefulset>-<hash> must stay within 63)" $field $full (len $full)) -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.labelKeys" -}}
{{- $v := .Values -}}
{{- /* Label and annotation keys: Kubernetes' qualified names ([prefix/]name); alert labels:
Prometheus label names. */ -}}
{{- $qualified := "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$" -}}
{{- $maps := dict "commonLabels" $v.commonLabels "metrics.serviceMonitor.labels" $v.metrics.serviceMonitor.labels "metrics.podMonitor.labels" $v.metrics.podMonitor.labels "metrics.prometheusRule.labels" $v.metrics.prometheusRule.labels "metrics.grafanaDashboard.labels" $v.metrics.grafanaDashboard.labels "metrics.grafanaDashboard.annotations" $v.metrics.grafanaDashboard.annotations "router.service.annotations" $v.router.service.annotations "router.serviceAccount.annotations" $v.router.serviceAccount.annotations "engine.serviceAccount.annotations" $v.engine.serviceAccount.annotations -}}
{{- range $role := append (include "pd-inference.engineRoles" . | fromJsonArray) "router" -}}
{{- range $m := list "podLabels" "podAnnotations" "nodeSelector" -}}
{{- $_ := set $maps (printf "%s.%s" $role $m) (get (get $v $role) $m) -}}
{{- end -}}
{{- end -}}
{{- range $field, $m := $maps -}}
{{- range $key, $_ := $m | default dict -}}
{{- if or (gt (len $key) 316) (not (regexMatch $qualified $key)) -}}
{{- fail (printf "%s: %q is not a valid key ([prefix/]name: a DNS subdomain prefix, a name of at most 63 letters, digits, '-', '_' or '.')" $field $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $key, $_ := $v.metrics.prometheusRule.alertLabels | default dict -}}
{{- if not (regexMatch "^[a-zA-Z_][a-zA-Z0-9_]*$" $key) -}}
{{- fail (printf "metrics.prometheusRule.alertLabels: %q is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)" $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.ownedLabels" -}}
{{- $v := .Values -}}
{{- /* Labels the chart sets itself: a user label with the same key would be a duplicate key
(refused at apply) or, on pods, break the selectors. */ -}}
{{- $owned := include "pd-inference.labels" (dict "ctx" (dict "Values" (dict) "Release" .Release "Chart" .Chart) "component" "x") | fromYaml -}}
{{- range $key, $_ := $v.commonLabels | default dict -}}
{{- if hasKey $owned $key -}}
{{- fail (printf "commonLabels.%s: this label is set by the chart" $key) -}}
{{- end -}}
{{- end -}}
{{- range $role := append (include "pd-inference.engineRoles" . | fromJsonArray) "router" -}}
{{- range $key, $_ := (get $v $role).podLabels | default dict -}}
{{- if or (hasKey $owned $key) (hasKey ($v.commonLabels | default dict) $key) -}}
{{- fail (printf "%s.podLabels.%s: this label is set by the chart (or commonLabels); pod labels cannot override it" $role $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
