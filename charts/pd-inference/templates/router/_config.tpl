{{/*
The router's config file (router/config.example.yaml documents the format; the router's own
loader, pd_router.config.load_config, validates it and tests/ load every rendered copy with it).
*/}}
{{- define "pd-inference.routerConfig" -}}
{{- $v := .Values -}}
{{- $r := $v.router -}}
{{- /* Ports from templates/_ports.tpl; the lmcache block names the LMCache mode's ports whatever the
connector, and kvEvents the KV-cache event ports whether or not the engines publish them. */ -}}
{{- $port := dict
  "listen" (include "pd-inference.port" (dict "ctx" . "component" "router" "name" "http") | int)
  "notify" (include "pd-inference.port" (dict "ctx" . "component" "router" "name" "pd-notify" "connector" "lmcache" "receiver" "router") | int)
  "sidecar" (include "pd-inference.port" (dict "ctx" . "component" "prefill" "name" "notify-sidecar" "connector" "lmcache" "receiver" "prefillSidecar") | int)
  "init" (include "pd-inference.portNumbers" (dict "ctx" . "component" "decode" "field" "ports.lmcacheInitBase" "connector" "lmcache") | fromJsonArray)
  "alloc" (include "pd-inference.portNumbers" (dict "ctx" . "component" "decode" "field" "ports.lmcacheAllocBase" "connector" "lmcache") | fromJsonArray)
  "kvEvents" (include "pd-inference.port" (dict "ctx" . "component" "decode" "name" "kv-events" "kvEvents" true) | int)
  "kvReplay" (include "pd-inference.port" (dict "ctx" . "component" "decode" "name" "kv-replay" "kvEvents" true) | int)
-}}
{{- $cfg := dict
  "listen" (dict "host" "0.0.0.0" "port" $port.listen "workers" (include "pd-inference.routerWorkers" . | int))
  "model" (dict "servedName" $v.model.servedName "adapters" (include "pd-inference.loraNames" . | fromJsonArray) "tokenizer" $v.model.routerTokenizer "reasoningParser" $v.model.reasoningParser "tokenizerHub" (dict
    "repo" (ternary $v.model.name "" $v.model.routerTokenizerFromHub)
    "revision" ($v.model.revision | default "main")
    "endpoint" ($v.model.hubEndpoint | default (include "pd-inference.defaultHubEndpoint" .))
    "tokenFile" (ternary (include "pd-inference.hfTokenFile" .) "" (eq (include "pd-inference.routerNeedsHfToken" .) "true"))
    "timeoutSeconds" (include "pd-inference.routerTokenizerFetchSeconds" . | int)))
  "routing" (dict "connector" $v.kvTransfer.connector "threshold" (int $r.threshold) "sessionAffinityHeader" $r.sessionAffinityHeader "decision" $r.decision
    "prefixCache" (dict "capacityTokens" (int $r.prefixCache.capacityTokens) "maxLoadImbalance" (int $r.prefixCache.maxLoadImbalance))
    "prefillBusy" (dict "queuedTokens" (int $r.prefillBusy.queuedTokens) "maxDecoderRequests" (int $r.prefillBusy.maxDecoderRequests))
    "kvEvents" (dict "enabled" $v.engine.kvEvents.enabled "port" $port.kvEvents "replayPort" $port.kvReplay "topic" (include "pd-inference.kvEventsTopic" .)))
  "remoteModels" (include "pd-inference.remoteModels" . | fromJsonArray)
  "pools" dict
  "lmcache" (dict
    "notifyBindHost" "0.0.0.0"
    "notifyPort" $port.notify
    "notificationsPerRequest" (int $v.prefill.tensorParallelSize)
    "decoderInitPorts" $port.init
    "decoderAllocPorts" $port.alloc
    "notifyTimeoutSeconds" (int $v.kvTransfer.lmcache.notifyTimeoutSeconds)
    "notificationReceiver" $v.kvTransfer.lmcache.notificationReceiver
    "sidecarPort" $port.sidecar)
  "timeouts" (dict "clientBodySeconds" (int $r.timeouts.clientBodySeconds) "connectSeconds" (int $r.timeouts.connectSeconds) "prefillSeconds" (int $r.timeouts.prefillSeconds) "firstByteSeconds" (int $r.timeouts.firstByteSeconds) "streamIdleSeconds" (int $r.timeouts.streamIdleSeconds) "clientHeaderSeconds" (int $r.timeouts.clientHeaderSeconds) "clientIdleSeconds" (int $r.timeouts.clientIdleSeconds))
  "health" (dict "path" "/health" "intervalSeconds" (int $r.health.intervalSeconds) "timeoutSeconds" (int $r.health.timeoutSeconds) "healthyThreshold" (int $r.health.healthyThreshold) "unhealthyThreshold" (int $r.health.unhealthyThreshold) "passiveFailureThreshold" (int $r.health.passiveFailureThreshold) "ejectionSeconds" (int $r.health.ejectionSeconds) "maxEjectionSeconds" (int $r.health.maxEjectionSeconds) "stallSeconds" (int $r.health.stallSeconds) "weightsCheck" $r.health.weightsCheck)
  "limits" (dict "maxInFlight" (int $r.limits.maxInFlight) "maxQueued" (int $r.limits.maxQueued) "queueTimeoutSeconds" (int $r.limits.queueTimeoutSeconds) "maxBodyBytes" (int64 $r.limits.maxBodyBytes) "maxHeaders" (int $r.limits.maxHeaders))
  "auth" (dict "apiKeysFile" (ternary (printf "%s/%s" (include "pd-inference.routerKeysDir" .) $r.auth.secretKey) "" (not (empty $r.auth.existingSecret))) "protectMetrics" $r.auth.protectMetrics "metricsTokensFile" (ternary (printf "%s/%s" (include "pd-inference.routerMetricsTokenDir" .) $r.auth.metricsTokenSecret.key) "" (not (empty $r.auth.metricsTokenSecret.name))))
  "logging" (dict "level" $r.logLevel "logPrompts" $r.logPrompts)
-}}
{{- /* One pool per engine role that renders, each the role's headless Service. Flexible: decode
alone and pools.layout (the router refuses a pools.prefill there); split renders no layout key,
the router's default, so a split release's config is unchanged. */ -}}
{{- range $role := include "pd-inference.engineRoles" . | fromJsonArray -}}
{{- $_ := set $cfg.pools $role (dict "discovery" "dns" "static" list "dns" (dict "name" (include "pd-inference.serviceFqdn" (dict "ctx" $ "component" $role)) "port" (include "pd-inference.port" (dict "ctx" $ "component" $role "name" "http") | int) "refreshSeconds" (int $r.discoveryRefreshSeconds))) -}}
{{- end -}}
{{- if include "pd-inference.flexible" . -}}
{{- $_ := set $cfg.pools "layout" $v.engine.layout -}}
{{- end -}}
{{- /* The goodput decision's SLOs, only with it: other releases keep their config, and so their pods. */ -}}
{{- if eq $r.decision "goodput" -}}
{{- $g := $r.goodput -}}
{{- $_ := set $cfg.routing "goodput" (dict
  "ttftSeconds" $g.ttftSeconds
  "ttftSecondsPerKiloToken" $g.ttftSecondsPerKiloToken
  "itlSeconds" $g.itlSeconds
  "windowSeconds" $g.windowSeconds
  "seed" (dict "prefillTokensPerSecond" $g.seed.prefillTokensPerSecond "decodeStepSeconds" $g.seed.decodeStepSeconds "handoffSeconds" $g.seed.handoffSeconds "chunkTokens" $g.seed.chunkTokens "crowding" $g.seed.crowding)) -}}
{{- end -}}
{{- /* Only when on: a release that does not trace keeps its router config, and so its pods. */ -}}
{{- if include "pd-inference.tracing.on" . -}}
{{- $t := $v.tracing -}}
{{- $_ := set $cfg "tracing" (dict
  "endpoint" $t.endpoint
  "protocol" $t.protocol
  "samplingRatio" $t.samplingRatio
  "serviceName" (include "pd-inference.componentName" (dict "ctx" . "component" "router"))
  "headersFile" (ternary (printf "%s/%s" (include "pd-inference.tracing.headersDir" .) $t.headersSecret.key) "" (not (empty $t.headersSecret.name)))) -}}
{{- end -}}
{{- /* Go writes a float of no fraction in exponent form without a point (1e-05, 1e+06), which
YAML 1.1 (the router's PyYAML) reads as a string: give such a mantissa its point. Quoted strings
are never touched (Go quotes a string that reads as a number). */ -}}
{{- regexReplaceAll "(?m)(: -?[0-9]+)([eE][-+][0-9]+)$" (toYaml $cfg) "${1}.0${2}" -}}
{{- end -}}

{{/*
Router worker processes: router.workers, or (0) the CPU the pod gets (limits.cpu, else
requests.cpu) rounded up; 1 when the router binds the LMCache notification socket itself.
*/}}
{{- define "pd-inference.routerWorkers" -}}
{{- $r := .Values.router -}}
{{- $n := int $r.workers -}}
{{- if eq (include "pd-inference.routerReceivesNotifications" .) "true" -}}
{{- $n = 1 -}}
{{- else if eq $n 0 -}}
{{- $res := $r.resources | default dict -}}
{{- $cpu := dig "limits" "cpu" (dig "requests" "cpu" "1" $res) $res | toString -}}
{{- if hasSuffix "m" $cpu -}}
{{- $n = int (ceil (divf (trimSuffix "m" $cpu | float64) 1000)) -}}
{{- else -}}
{{- $n = int (ceil ($cpu | float64)) -}}
{{- end -}}
{{- $n = max 1 (min 64 $n) -}}
{{- end -}}
{{- $n -}}
{{- end -}}

{{- define "pd-inference.routerKeysDir" -}}/etc/pd-router/api-keys{{- end -}}
{{- define "pd-inference.routerMetricsTokenDir" -}}/etc/pd-router/metrics-token{{- end -}}
{{- define "pd-inference.routerConfigDir" -}}/etc/pd-router{{- end -}}
{{- define "pd-inference.routerConfigFile" -}}router.yaml{{- end -}}

{{/* The router config's remoteModels: each other release's model and router URL (pd_router.remotes). */}}
{{- define "pd-inference.remoteModels" -}}
{{- $out := list -}}
{{- range .Values.router.remoteModels -}}
{{- $out = append $out (dict "name" .name "url" .url) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}
