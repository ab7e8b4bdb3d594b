{{/* The router: its entry points (Gateway API), its tokenizer, what it refuses at start-up, its config, autoscaling, auth and the alerts' needs. Included by pd-inference.validate (templates/_validate.tpl), in its order. */}}

{{- define "pd-inference.validate.gateway" -}}
{{- $v := .Values -}}
{{- /* Gateway API: a route attached to nothing, and timeouts the API server would refuse. */ -}}
{{- $route := $v.router.httpRoute -}}
{{- if $route.enabled -}}
{{- if not $route.parentRefs -}}
{{- fail "router.httpRoute.parentRefs: name at least one Gateway the route attaches to (e.g. [{name: inference, namespace: gateways}])" -}}
{{- end -}}
{{- $request := include "pd-inference.gatewayDurationMs" $route.timeouts.request | int64 -}}
{{- $backend := include "pd-inference.gatewayDurationMs" $route.timeouts.backendRequest | int64 -}}
{{- if and (gt $request 0) (gt $backend $request) -}}
{{- fail (printf "router.httpRoute.timeouts.backendRequest: %s is longer than timeouts.request %s (the Gateway API refuses it)" $route.timeouts.backendRequest $route.timeouts.request) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.tokenizer" -}}
{{- $v := .Values -}}
{{- /* The router's tokenizer: one source, and a hub model id to fetch it by. */ -}}
{{- if $v.model.routerTokenizerFromHub -}}
{{- if $v.model.routerTokenizer -}}
{{- fail "model.routerTokenizerFromHub: the router takes its tokenizer from model.routerTokenizer (a file) or from the hub, not both; empty one of them" -}}
{{- end -}}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$" $v.model.name) -}}
{{- fail (printf "model.routerTokenizerFromHub: model.name %q is not a hub model id (org/name), so there is no tokenizer to fetch; set model.routerTokenizer to a file instead" $v.model.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.routerLimits" -}}
{{- $v := .Values -}}
{{- /* What the router itself refuses at start-up with the notification sidecar (files/router-limits.yaml,
generated from pd_router.config). */ -}}
{{- if eq (include "pd-inference.notificationSidecar" .) "true" -}}
{{- $limits := .Files.Get "files/router-limits.yaml" | fromYaml -}}
{{- if gt (int $v.kvTransfer.lmcache.notifyTimeoutSeconds) (int $limits.sidecarMaxNotifyTimeoutSeconds) -}}
{{- fail (printf "kvTransfer.lmcache.notifyTimeoutSeconds: %d is above %d, the longest wait the notification sidecar serves (notificationReceiver prefillSidecar)" (int $v.kvTransfer.lmcache.notifyTimeoutSeconds) (int $limits.sidecarMaxNotifyTimeoutSeconds)) -}}
{{- end -}}
{{- if gt (int $v.prefill.tensorParallelSize) (int $limits.sidecarMaxNotificationsPerRequest) -}}
{{- fail (printf "prefill.tensorParallelSize: %d notifications per request (one per TP rank) is above %d, what the notification sidecar waits for" (int $v.prefill.tensorParallelSize) (int $limits.sidecarMaxNotificationsPerRequest)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.routerEnv" -}}
{{- $v := .Values -}}
{{- /* The router's config file is the chart's: PD_ROUTER__* env overrides would silently change it. */ -}}
{{- range $e := $v.router.env | default list -}}
{{- if hasPrefix "PD_ROUTER__" (upper $e.name) -}}
{{- fail (printf "router.env: %s overrides the router config the chart renders; set the matching router.* value instead" $e.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.router" -}}
{{- $v := .Values -}}
{{- if and $v.router.autoscaling.enabled (gt (int $v.router.autoscaling.minReplicas) (int $v.router.autoscaling.maxReplicas)) -}}
{{- fail (printf "router.autoscaling.minReplicas: %d is above router.autoscaling.maxReplicas (%d)" (int $v.router.autoscaling.minReplicas) (int $v.router.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- if ge (int $v.router.threshold) (int $v.model.maxModelLen) -}}
{{- fail (printf "router.threshold: %d tokens is not below model.maxModelLen (%d), so no request could ever be disaggregated" (int $v.router.threshold) (int $v.model.maxModelLen)) -}}
{{- end -}}
{{- if and $v.router.auth.protectMetrics (not $v.router.auth.existingSecret) -}}
{{- fail "router.auth.protectMetrics: needs router.auth.existingSecret (API keys): protecting /metrics while the API stays open protects nothing worth it" -}}
{{- end -}}
{{- if and $v.metrics.prometheusRule.enabled (not (and $v.metrics.serviceMonitor.enabled $v.metrics.podMonitor.enabled)) -}}
{{- fail "metrics.prometheusRule.enabled: the alerts compare the router's series with the engines', so they need metrics.serviceMonitor.enabled and metrics.podMonitor.enabled (with one missing, PDInferenceKVTransferStalled would page on every request)" -}}
{{- end -}}
{{- if hasKey $v.metrics.prometheusRule.alertLabels "severity" -}}
{{- fail "metrics.prometheusRule.alertLabels.severity: each alert sets its own severity (critical or warning); route on it instead" -}}
{{- end -}}
{{- if and $v.router.auth.metricsTokenSecret.name (not $v.router.auth.protectMetrics) -}}
{{- fail "router.auth.metricsTokenSecret.name: a metrics token is only used with router.auth.protectMetrics: true (an unprotected /metrics needs none)" -}}
{{- end -}}
{{- if and $v.router.auth.protectMetrics $v.metrics.serviceMonitor.enabled (not $v.router.auth.metricsTokenSecret.name) -}}
{{- fail "router.auth.metricsTokenSecret.name: the router's /metrics is protected (router.auth.protectMetrics) and metrics.serviceMonitor.enabled, so Prometheus needs a credential: name a Secret whose key router.auth.metricsTokenSecret.key holds a metrics-only token" -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.remoteModels" -}}
{{- $v := .Values -}}
{{- /* Another release's model: a name of its own (not this release's model or adapters, nor another entry's). */ -}}
{{- $own := dict $v.model.servedName "model.servedName" -}}
{{- range $i, $a := $v.model.lora.adapters -}}
{{- $_ := set $own $a.name (printf "model.lora.adapters[%d].name" $i) -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $i, $r := $v.router.remoteModels -}}
{{- if hasKey $own $r.name -}}
{{- fail (printf "router.remoteModels[%d].name: %q is this release's %s; a remote model is another release's" $i $r.name (get $own $r.name)) -}}
{{- end -}}
{{- if hasKey $seen $r.name -}}
{{- fail (printf "router.remoteModels[%d].name: %q is router.remoteModels[%d]'s too; one entry per model" $i $r.name (get $seen $r.name)) -}}
{{- end -}}
{{- $_ := set $seen $r.name $i -}}
{{- if and (eq $r.release $.Release.Name) (eq ($r.namespace | default $.Release.Namespace) $.Release.Namespace) -}}
{{- fail (printf "router.remoteModels[%d].release: %q in namespace %q is this release: a router cannot front itself" $i $r.release ($r.namespace | default $.Release.Namespace)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
