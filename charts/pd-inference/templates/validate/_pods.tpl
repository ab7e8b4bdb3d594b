{{/* Every pod: zone placement, security context, probes and the preflight's window, resources. Included by pd-inference.validate (templates/_validate.tpl), in its order. */}}

{{- define "pd-inference.validate.zone" -}}
{{- $v := .Values -}}
{{- /* Placement: EFA does not cross availability zones. */ -}}
{{- if and $v.efa.enabled (not $v.placement.sameZone) (not $v.placement.zone) -}}
{{- fail "placement.sameZone: EFA traffic does not cross availability zones; keep placement.sameZone=true or pin placement.zone when efa.enabled=true" -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.pods" -}}
{{- $v := .Values -}}
{{- /* Root in a pod that must not run as root: every container the chart renders sets
runAsNonRoot: true, so with runAsUser 0 the kubelet refuses to start them
(CreateContainerConfigError), whatever the pod's own runAsNonRoot says. */ -}}
{{- range $field, $psc := dict "engine.podSecurityContext" $v.engine.podSecurityContext "router.podSecurityContext" $v.router.podSecurityContext -}}
{{- $psc = $psc | default dict -}}
{{- if and (hasKey $psc "runAsUser") (not (kindIs "invalid" $psc.runAsUser)) (eq (int64 $psc.runAsUser) 0) -}}
{{- $also := ternary (printf " and %s.runAsNonRoot is true" $field) "" (eq (toString $psc.runAsNonRoot) "true") -}}
{{- fail (printf "%s.runAsUser: 0 is root, but every container the chart renders sets runAsNonRoot: true%s, so the kubelet would refuse to start them; use a non-zero UID (the images run as 10001)" $field $also) -}}
{{- end -}}
{{- end -}}

{{- /* A check whose timeout is longer than its interval: the next one starts only when it ends, so
the interval, and the failure detection it bounds, silently stretch to the timeout. */ -}}
{{- range $probe := list "startup" "readiness" "liveness" -}}
{{- $p := get $v.engine.probes $probe -}}
{{- if gt (int $p.timeoutSeconds) (int $p.periodSeconds) -}}
{{- fail (printf "engine.probes.%s.timeoutSeconds: %d is longer than engine.probes.%s.periodSeconds (%d); make the timeout at most the period" $probe (int $p.timeoutSeconds) $probe (int $p.periodSeconds)) -}}
{{- end -}}
{{- end -}}
{{- if gt (int $v.router.health.timeoutSeconds) (int $v.router.health.intervalSeconds) -}}
{{- fail (printf "router.health.timeoutSeconds: %d is longer than router.health.intervalSeconds (%d); make the timeout at most the interval" (int $v.router.health.timeoutSeconds) (int $v.router.health.intervalSeconds)) -}}
{{- end -}}
{{- /* The preflight runs inside the startup window, before vLLM loads the model: a deadline past
the window means the kubelet restarts a hanging preflight before it can name the problem. */ -}}
{{- $startup := $v.engine.probes.startup -}}
{{- $window := mul (int $startup.periodSeconds) (int $startup.failureThreshold) -}}
{{- if and $v.engine.preflight.enabled (ge (int $v.engine.preflight.timeoutSeconds) (int $window)) -}}
{{- fail (printf "engine.preflight.timeoutSeconds: %d is not below the startup window of %d s (engine.probes.startup.periodSeconds x failureThreshold), which must also cover loading the model" (int $v.engine.preflight.timeoutSeconds) (int $window)) -}}
{{- end -}}
{{- end -}}

{{- define "pd-inference.validate.resources" -}}
{{- $v := .Values -}}
{{- /* Resource requests above their limits, in every resources block of the values (the API
server refuses them at apply). Malformed quantities never get here: the schema's Quantity
definition carries the quantity pattern (ci/chartdoc.py QUANTITY_PATTERN). */ -}}
{{- $resources := dict "prefill.resources" $v.prefill.resources "decode.resources" $v.decode.resources "router.resources" $v.router.resources "engine.metricsProxy.resources" $v.engine.metricsProxy.resources "kvTransfer.lmcache.sidecar.resources" $v.kvTransfer.lmcache.sidecar.resources -}}
{{- range $field, $res := $resources -}}
{{- $res = $res | default dict -}}
{{- range $name, $req := $res.requests | default dict -}}
{{- with get ($res.limits | default dict) $name -}}
{{- if gt (include "pd-inference.quantity" $req | float64) (include "pd-inference.quantity" . | float64) -}}
{{- fail (printf "%s.requests.%s: %v is above its limit %v" $field $name $req .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
