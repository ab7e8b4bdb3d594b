{{/*
Rules the JSON schema cannot express. Each failure names the values field to change.
Included once, from templates/validate.yaml, so `helm template` and `helm install` both stop.
Each rule group is a define of its own in templates/validate/, grouped by topic; this is their
order (the first rule broken is the one reported).
*/}}
{{- define "pd-inference.validate" -}}
{{- include "pd-inference.validate.moved" . -}}
{{- include "pd-inference.validate.model" . -}}
{{- include "pd-inference.validate.lora" . -}}
{{- include "pd-inference.validate.lmcacheMp" . -}}
{{- include "pd-inference.validate.layout" . -}}
{{- include "pd-inference.validate.notifications" . -}}
{{- include "pd-inference.validate.tracing" . -}}
{{- include "pd-inference.validate.gateway" . -}}
{{- include "pd-inference.validate.remoteModels" . -}}
{{- include "pd-inference.validate.kvBuffer" . -}}
{{- include "pd-inference.validate.tokenizer" . -}}
{{- include "pd-inference.validate.zone" . -}}
{{- include "pd-inference.validate.pods" . -}}
{{- include "pd-inference.validate.ports" . -}}
{{- include "pd-inference.validate.names" . -}}
{{- include "pd-inference.validate.labelKeys" . -}}
{{- include "pd-inference.validate.routerLimits" . -}}
{{- include "pd-inference.validate.ownedLabels" . -}}
{{- include "pd-inference.validate.routerEnv" . -}}
{{- include "pd-inference.validate.kvOverEfa" . -}}
{{- include "pd-inference.validate.resources" . -}}
{{- include "pd-inference.validate.roles" . -}}
{{- include "pd-inference.validate.router" . -}}
{{- end -}}
