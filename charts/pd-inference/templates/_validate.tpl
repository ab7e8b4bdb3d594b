{{/*
Rules the JSON schema cannot express. Each failure names the values field to change.
Included once, from templates/validate.yaml, so `helm template` and `helm install` both stop.
*/}}
{{- define "pd-inference.validate" -}}
{{- $v := .Values -}}
{{- $lmcache := eq $v.kvTransfer.connector "lmcache" -}}

{{- /* Values that moved (files/moved-values.yaml): the schema lets the old key through so that this names the new one. */ -}}
{{- range $old, $move := .Files.Get "files/moved-values.yaml" | fromYaml -}}
{{- if hasKey $v $old -}}
{{- fail (printf "%s: moved to %s in chart %s; put these values under %s (chart README, \"Upgrading\")" $old $move.to $move.since $move.to) -}}
{{- end -}}
{{- end -}}

{{- /*
What the pinned vLLM can serve. LMCacheConnectorV1 does not implement vLLM's SupportsHMA (vLLM
0.31.0 and 0.33.0: kv_connector/v1/lmcache_connector.py), so with a hybrid model vLLM turns the
hybrid KV-cache manager off and the model fails at start-up or when a request finishes (the
scheduler asserts one KV-cache group). NixlConnector implements SupportsHMA. The real-engine tier
(tests/engines/) checks both facts against the installed vLLM versions.
*/ -}}
{{- if and $lmcache (eq (include "pd-inference.hybridModel" .) "true") -}}
{{- $why := ternary "model.attention is hybrid" "model.name is a hybrid model family (linear-attention or Mamba layers besides attention; set model.attention: full only if this model has attention in every layer)" (eq $v.model.attention "hybrid") -}}
{{- fail (printf "kvTransfer.connector: lmcache cannot serve %s: %s, and vLLM's LMCacheConnectorV1 does not support hybrid KV-cache models (no SupportsHMA in vLLM %s); use kvTransfer.connector: nixl, or a full-attention model" $v.model.name $why (index .Chart.Annotations "pd-inference.io/checked-vllm" | replace "," ", ")) -}}
{{- end -}}

{{- /* The flexible layout (engine.layout): one pool of decode engines, each NixlConnector kv_both. */ -}}
{{- if include "pd-inference.flexible" . -}}
{{- if $lmcache -}}
{{- fail "kvTransfer.connector: lmcache cannot serve engine.layout flexible: an LMCache PD engine is a sender or a receiver (pd_role), never both, and a flexible engine takes either part; use kvTransfer.connector: nixl, or engine.layout: split" -}}
{{- end -}}
{{- if gt (int $v.prefill.replicas) 0 -}}
{{- fail (printf "prefill.replicas: %d prefill engines with engine.layout flexible; set prefill.replicas: 0, every engine is a decode engine that also prefills (decode.replicas counts them)" (int $v.prefill.replicas)) -}}
{{- end -}}
{{- if $v.prefill.autoscaling.enabled -}}
{{- fail "prefill.autoscaling.enabled: no prefill engine runs with engine.layout flexible (every engine is a decode engine that also prefills); autoscale the pool with decode.autoscaling instead" -}}
{{- end -}}
{{- /* NixlConnector's kv_both on a multi-node or data-parallel engine is not checked here (the
real-engine tier runs one-node engines of one rank with it): refused until it is. */ -}}
{{- if gt (int $v.decode.nodes) 1 -}}
{{- fail (printf "decode.nodes: %d nodes per engine with engine.layout flexible; multi-node engines are not checked with NixlConnector kv_both, so set decode.nodes: 1 (or engine.layout: split)" (int $v.decode.nodes)) -}}
{{- end -}}
{{- if gt (int $v.decode.dataParallelSize) 1 -}}
{{- fail (printf "decode.dataParallelSize: %d data-parallel ranks with engine.layout flexible; data-parallel engines are not checked with NixlConnector kv_both, so set decode.dataParallelSize: 1 (or engine.layout: split)" (int $v.decode.dataParallelSize)) -}}
{{- end -}}
{{- end -}}
{{- /* The goodput decision names the prefiller and the decoder of each hand-off: NIXL only (pd_router.config). */ -}}
{{- if and $lmcache (eq $v.router.decision "goodput") -}}
{{- fail "router.decision: goodput needs kvTransfer.connector: nixl, as the router does (it names the prefiller and the decoder of each hand-off); use kvTransfer.connector: nixl, or router.decision: prefix or length" -}}
{{- end -}}

{{- /* One notification host in LMCache mode: several routers would miss each other's notifications. */ -}}
{{- $single := eq (include "pd-inference.routerReceivesNotifications" .) "true" -}}
{{- if and $single (gt (int $v.router.replicas) 1) -}}
{{- fail (printf "router.replicas: %d router replicas need kvTransfer.lmcache.notificationReceiver=prefillSidecar (or kvTransfer.connector=nixl); with notificationReceiver=router the prefillers notify a single router (pd_proxy_host)" (int $v.router.replicas)) -}}
{{- end -}}
{{- if lt (int $v.router.health.maxEjectionSeconds) (int $v.router.health.ejectionSeconds) -}}
{{- fail (printf "router.health.maxEjectionSeconds: must be >= router.health.ejectionSeconds (%d), got %d" (int $v.router.health.ejectionSeconds) (int $v.router.health.maxEjectionSeconds)) -}}
{{- end -}}
{{- if and $single (gt (int $v.router.workers) 1) -}}
{{- fail (printf "router.workers: %d worker processes need kvTransfer.lmcache.notificationReceiver=prefillSidecar (or kvTransfer.connector=nixl); with notificationReceiver=router one process binds the notification socket" (int $v.router.workers)) -}}
{{- end -}}
{{- if and $single $v.router.autoscaling.enabled -}}
{{- fail "router.autoscaling.enabled: router autoscaling needs kvTransfer.lmcache.notificationReceiver=prefillSidecar (or kvTransfer.connector=nixl); with notificationReceiver=router the prefillers notify a single router" -}}
{{- end -}}
{{- if and $lmcache (ne (int $v.prefill.tensorParallelSize) (int $v.decode.tensorParallelSize)) -}}
{{- fail (printf "decode.tensorParallelSize: LMCache PD sends one KV shard and one notification per TP rank, so prefill.tensorParallelSize (%d) and decode.tensorParallelSize (%d) must be equal" (int $v.prefill.tensorParallelSize) (int $v.decode.tensorParallelSize)) -}}
{{- end -}}

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

{{- /* KV buffer large enough for one max-length request (pd-protocols.md section 4). */ -}}
{{- $shape := $v.model.kvShape -}}
{{- if gt (int $shape.layers) 0 -}}
{{- range $f := list "kvHeads" "headDim" "bytesPerElement" -}}
{{- if le (int (get $shape $f)) 0 -}}
{{- fail (printf "model.kvShape.%s: must be > 0 when model.kvShape.layers is set" $f) -}}
{{- end -}}
{{- end -}}
{{- if $lmcache -}}
{{- $need := include "pd-inference.kvBytesPerRequest" . | int64 -}}
{{- if lt (int64 $v.kvTransfer.lmcache.bufferSize) $need -}}
{{- fail (printf "kvTransfer.lmcache.bufferSize: %d bytes per worker cannot hold one TP rank's share of the KV of a %d-token request (%d bytes for model.kvShape at tensorParallelSize %d)" (int64 $v.kvTransfer.lmcache.bufferSize) (int $v.model.maxModelLen) $need (int $v.decode.tensorParallelSize)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* LMCache keys the chart owns cannot be overridden through extraConfig. */ -}}
{{- range $line := .Files.Lines "files/lmcache-chart-owned-keys.txt" -}}
{{- $key := trim $line -}}
{{- if and $key (not (hasPrefix "#" $key)) (hasKey $v.kvTransfer.lmcache.extraConfig $key) -}}
{{- fail (printf "kvTransfer.lmcache.extraConfig.%s: this LMCache key is set by the chart; use the matching kvTransfer/ports value instead" $key) -}}
{{- end -}}
{{- end -}}

{{- /* The router's tokenizer: one source, and a hub model id to fetch it by. */ -}}
{{- if $v.model.routerTokenizerFromHub -}}
{{- if $v.model.routerTokenizer -}}
{{- fail "model.routerTokenizerFromHub: the router takes its tokenizer from model.routerTokenizer (a file) or from the hub, not both; empty one of them" -}}
{{- end -}}
{{- if not (regexMatch "^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$" $v.model.name) -}}
{{- fail (printf "model.routerTokenizerFromHub: model.name %q is not a hub model id (org/name), so there is no tokenizer to fetch; set model.routerTokenizer to a file instead" $v.model.name) -}}
{{- end -}}
{{- end -}}

{{- /* Placement: EFA does not cross availability zones. */ -}}
{{- if and $v.efa.enabled (not $v.placement.sameZone) (not $v.placement.zone) -}}
{{- fail "placement.sameZone: EFA traffic does not cross availability zones; keep placement.sameZone=true or pin placement.zone when efa.enabled=true" -}}
{{- end -}}

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

{{- include "pd-inference.validate.ports" . -}}

{{- /* Names: "<fullname>-prefill" is a StatefulSet whose pods carry the label
controller-revision-hash "<name>-<10-character hash>", at most 63 characters, so the fullname may
have at most 44 (a longer one used to be cut, and the prefill pods then never got created). */ -}}
{{- $full := $v.fullnameOverride | default (ternary .Release.Name (printf "%s-%s" .Release.Name (default .Chart.Name $v.nameOverride)) (contains (default .Chart.Name $v.nameOverride) .Release.Name)) -}}
{{- if gt (len $full) 44 -}}
{{- $field := ternary "fullnameOverride" "the release name (or set fullnameOverride)" (not (empty $v.fullnameOverride)) -}}
{{- fail (printf "%s: the objects' name prefix %q has %d characters; at most 44 fit (the StatefulSet <name>-prefill and its pods' controller-revision-hash label of <statefulset>-<hash> must stay within 63)" $field $full (len $full)) -}}
{{- end -}}

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

{{- /* The router's config file is the chart's: PD_ROUTER__* env overrides would silently change it. */ -}}
{{- range $e := $v.router.env | default list -}}
{{- if hasPrefix "PD_ROUTER__" (upper $e.name) -}}
{{- fail (printf "router.env: %s overrides the router config the chart renders; set the matching router.* value instead" $e.name) -}}
{{- end -}}
{{- end -}}

{{- /* KV transfer over EFA: UCX has no EFA transport (NIXL's LIBFABRIC backend drives EFA). */ -}}
{{- if and $v.efa.enabled (eq $v.kvTransfer.backend "UCX") -}}
{{- fail "kvTransfer.backend: UCX cannot use EFA devices (UCX has no EFA transport); use LIBFABRIC, or auto (LIBFABRIC with EFA), or turn efa.enabled off" -}}
{{- end -}}
{{- if and $lmcache (gt (int $v.kvTransfer.lmcache.chunkSize) (int $v.model.maxModelLen)) -}}
{{- fail (printf "kvTransfer.lmcache.chunkSize: %d tokens per chunk is above model.maxModelLen (%d): no request would fill a chunk" (int $v.kvTransfer.lmcache.chunkSize) (int $v.model.maxModelLen)) -}}
{{- end -}}

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

{{- $instanceTypes := include "pd-inference.instanceTypes" . | fromYaml -}}
{{- /* The roles that render: what is not rendered needs no check. */ -}}
{{- range $role := include "pd-inference.engineRoles" . | fromJsonArray -}}
{{- $r := get $v $role -}}
{{- /* Flags and environment variables the chart sets (templates/engine/_args.tpl). vLLM
accepts --a-b, --a_b, --a-b=v and -tp for --tensor-parallel-size. */ -}}
{{- $flags := dict "host" "the chart (0.0.0.0)" "port" "ports.engineHttp" "served-model-name" "model.servedName" "revision" "model.revision" "tensor-parallel-size" (printf "%s.tensorParallelSize" $role) "max-model-len" "model.maxModelLen" "gpu-memory-utilization" (printf "%s.gpuMemoryUtilization" $role) "shutdown-timeout" (printf "%s.drainSeconds" $role) "kv-transfer-config" "kvTransfer" "model" "model.name" "reasoning-parser" "model.reasoningParser" "enable-auto-tool-choice" "model.toolCallParser" "tool-call-parser" "model.toolCallParser" -}}
{{- range $flag := list "nnodes" "node-rank" "master-addr" "headless" -}}
{{- $_ := set $flags $flag (printf "%s.nodes" $role) -}}
{{- end -}}
{{- $_ := set $flags "data-parallel-size" (printf "%s.dataParallelSize" $role) -}}
{{- $_ := set $flags "enable-expert-parallel" (printf "%s.expertParallel" $role) -}}
{{- if $v.engine.kvEvents.enabled -}}
{{- $_ := set $flags "kv-events-config" "engine.kvEvents.enabled" -}}
{{- end -}}
{{- if include "pd-inference.tracing.engines" $ -}}
{{- $_ := set $flags "otlp-traces-endpoint" "tracing.endpoint" -}}
{{- $_ := set $flags "collect-detailed-traces" "tracing.engines.detailedTraces" -}}
{{- end -}}
{{- range $arg := include "pd-inference.engineArgs" (dict "ctx" $ "role" $role) | fromYamlArray -}}
{{- if hasPrefix "--" $arg -}}
{{- $n := trimPrefix "--" (first (splitList "=" $arg)) -}}
{{- if not (hasKey $flags $n) -}}
{{- fail (printf "chart bug: engine flag --%s has no owner in _validate.tpl" $n) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $arg := $r.extraArgs | default list -}}
{{- if hasPrefix "-" (toString $arg) -}}
{{- $n := replace "_" "-" (trimPrefix "-" (trimPrefix "-" (first (splitList "=" (toString $arg))))) -}}
{{- $n = ternary "tensor-parallel-size" $n (eq $n "tp") -}}
{{- $n = get (dict "dp" "data-parallel-size" "ep" "enable-expert-parallel" "n" "nnodes" "r" "node-rank") $n | default $n -}}
{{- /* KV-cache events: vLLM's parser takes the last --kv-events-config (a dotted
--kv-events-config.topic=x becomes one too), and without prefix caching vLLM stores no block
to publish; either way the router would subscribe to nothing. */ -}}
{{- if $v.engine.kvEvents.enabled -}}
{{- if or (eq $n "kv-events-config") (hasPrefix "kv-events-config." $n) -}}
{{- fail (printf "%s.extraArgs: %s would replace the --kv-events-config the chart sets while engine.kvEvents.enabled is true, and the router would subscribe to nothing; remove it (the ports are ports.kvEvents and ports.kvEventsReplay), or set engine.kvEvents.enabled=false to publish your own" $role (toString $arg)) -}}
{{- end -}}
{{- if eq $n "no-enable-prefix-caching" -}}
{{- fail (printf "%s.extraArgs: %s turns vLLM's prefix cache off, so the engine stores no KV block to publish and the router's KV-cache events (engine.kvEvents.enabled) would stay empty; remove it, or set engine.kvEvents.enabled=false" $role (toString $arg)) -}}
{{- end -}}
{{- end -}}
{{- if hasKey $flags $n -}}
{{- fail (printf "%s.extraArgs: %s is set by the chart (from %s); set that value instead" $role (toString $arg) (get $flags $n)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $ownedEnv := dict -}}
{{- range $e := include "pd-inference.engineEnv" (dict "ctx" $ "role" $role) | fromYamlArray -}}
{{- $_ := set $ownedEnv $e.name true -}}
{{- end -}}
{{- range $field := list "engine.env" (printf "%s.env" $role) -}}
{{- range $e := (ternary $v.engine.env $r.env (eq $field "engine.env")) | default list -}}
{{- if hasKey $ownedEnv $e.name -}}
{{- fail (printf "%s: %s is set by the chart; it cannot be overridden here" $field $e.name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* The drain (engine/_pod.tpl): the kubelet's SIGKILL must come after the preStop wait and
vLLM's drain, or the requests it is finishing die with it. */ -}}
{{- $preStop := include "pd-inference.engine.preStopSeconds" $ | int -}}
{{- if le (int $r.terminationGracePeriodSeconds) (add $preStop (int $r.drainSeconds)) -}}
{{- fail (printf "%s.terminationGracePeriodSeconds: %d s must be longer than the preStop wait (%d s: router.discoveryRefreshSeconds %d + engine.drain.dnsCacheSeconds %d) plus %s.drainSeconds (%d s), or vLLM is killed while it finishes in-flight requests; raise it above %d" $role (int $r.terminationGracePeriodSeconds) $preStop (int $v.router.discoveryRefreshSeconds) (int $v.engine.drain.dnsCacheSeconds) $role (int $r.drainSeconds) (add $preStop (int $r.drainSeconds))) -}}
{{- end -}}
{{- /* vLLM shards KV heads over TP ranks: one must divide the other. */ -}}
{{- $heads := int $v.model.kvShape.kvHeads -}}
{{- $tp := int $r.tensorParallelSize -}}
{{- if and (gt $heads 0) (ne (mod $heads $tp) 0) (ne (mod $tp $heads) 0) -}}
{{- fail (printf "%s.tensorParallelSize: %d neither divides model.kvShape.kvHeads (%d) nor is a multiple of it; vLLM cannot shard the KV heads" $role $tp $heads) -}}
{{- end -}}
{{- /* Multi-node and data-parallel engines (engine/_multinode.tpl, engine/_args.tpl). */ -}}
{{- $nodes := int $r.nodes -}}
{{- $dp := int $r.dataParallelSize -}}
{{- $gpus := mul (int $r.tensorParallelSize) $dp -}}
{{- if and $lmcache (or (gt $nodes 1) (gt $dp 1)) -}}
{{- fail (printf "%s: kvTransfer.connector lmcache serves one-node engines of one data-parallel rank: LMCache PD's config names one decoder host per engine with one receiver port per TP rank (vLLM ranks on other pods, or other DP ranks, are not addressed); use kvTransfer.connector: nixl" (ternary (printf "%s.nodes" $role) (printf "%s.dataParallelSize" $role) (gt $nodes 1))) -}}
{{- end -}}
{{- if ne (mod $gpus $nodes) 0 -}}
{{- fail (printf "%s.nodes: %d nodes cannot share the engine's %d GPUs (tensorParallelSize %d x dataParallelSize %d) evenly; vLLM splits its world size evenly over --nnodes" $role $nodes $gpus (int $r.tensorParallelSize) $dp) -}}
{{- end -}}
{{- if and (gt $nodes 1) (gt $dp 1) (ne (mod $dp $nodes) 0) -}}
{{- fail (printf "%s.dataParallelSize: %d data-parallel ranks do not split evenly over %s.nodes (%d); each pod runs whole ranks (vLLM infers a node's ranks from --node-rank)" $role $dp $role $nodes) -}}
{{- end -}}
{{- if and $r.groupTopologyKey (le $nodes 1) -}}
{{- fail (printf "%s.groupTopologyKey: places the pods of a multi-node engine's group; %s.nodes is 1" $role $role) -}}
{{- end -}}
{{- if and $v.engine.kvEvents.enabled (gt $dp 1) -}}
{{- fail (printf "engine.kvEvents.enabled: with %s.dataParallelSize %d every rank publishes its own events (ports.kvEvents + rank, on the pod that runs it) and the router subscribes to one port of each Service endpoint; turn the events off (the router then estimates prefixes itself)" $role $dp) -}}
{{- end -}}
{{- if gt $nodes 1 -}}
{{- /* LWS v0.9.0's webhook wants its name a DNS-1035 label (it names its headless Service): a letter first. */ -}}
{{- if not (regexMatch "^[a-z]" (include "pd-inference.engine.groupName" (dict "ctx" $ "role" $role))) -}}
{{- fail (printf "%s.nodes: the LeaderWorkerSet name %s must start with a letter (LeaderWorkerSet names its Service after it: a DNS-1035 label); use a release name or fullnameOverride that does" $role (include "pd-inference.engine.groupName" (dict "ctx" $ "role" $role))) -}}
{{- end -}}
{{- /* The worker StatefulSet <group>-<index> labels its pods controller-revision-hash <statefulset>-<10-character hash>: within 63. */ -}}
{{- $groups := max (int $r.replicas) (ternary (int $r.autoscaling.maxReplicas) 0 $r.autoscaling.enabled) 1 -}}
{{- $longest := add (len (include "pd-inference.engine.groupName" (dict "ctx" $ "role" $role))) 1 (len (toString (sub $groups 1))) 11 -}}
{{- if gt $longest 63 -}}
{{- fail (printf "%s.nodes: the LeaderWorkerSet %s's worker pods would carry a controller-revision-hash label of %d characters (at most 63); shorten the release name or fullnameOverride" $role (include "pd-inference.engine.groupName" (dict "ctx" $ "role" $role)) $longest) -}}
{{- end -}}
{{- end -}}
{{- /* Placement that cannot work: more GPUs or EFA devices than the pinned instance type has. */ -}}
{{- with get $instanceTypes $r.instanceType -}}
{{- $perPod := include "pd-inference.engine.gpusPerPod" $r | int -}}
{{- if gt $perPod (int .gpus) -}}
{{- if gt $nodes 1 -}}
{{- fail (printf "%s.nodes: %d GPUs per pod (tensorParallelSize %d x dataParallelSize %d over %d nodes), but %s.instanceType %s has %d; the pods could never be scheduled" $role $perPod (int $r.tensorParallelSize) $dp $nodes $role $r.instanceType (int .gpus)) -}}
{{- end -}}
{{- fail (printf "%s.%s: %d GPUs per pod, but %s.instanceType %s has %d; the pod could never be scheduled (or spread the engine over more %s.nodes)" $role (ternary "tensorParallelSize" "dataParallelSize" (eq $dp 1)) $perPod $role $r.instanceType (int .gpus) $role) -}}
{{- end -}}
{{- if and $v.efa.enabled (eq (int .efa) 0) -}}
{{- fail (printf "efa.enabled: %s.instanceType %s has no EFA; turn EFA off or pick an EFA instance type" $role $r.instanceType) -}}
{{- end -}}
{{- if and $v.efa.enabled (gt (int $v.efa.devices) (int .efa)) -}}
{{- fail (printf "efa.devices: %d EFA devices per pod, but %s.instanceType %s has %d" (int $v.efa.devices) $role $r.instanceType (int .efa)) -}}
{{- end -}}
{{- end -}}
{{- /* The chart owns accelerator resources: they follow tensorParallelSize and efa.* */ -}}
{{- range $kind := list "requests" "limits" -}}
{{- $res := get ($r.resources | default dict) $kind | default dict -}}
{{- range $owned := list "nvidia.com/gpu" "vpc.amazonaws.com/efa" "hugepages-2Mi" -}}
{{- if hasKey $res $owned -}}
{{- fail (printf "%s.resources.%s.%s: set by the chart (tensorParallelSize, efa.devices, efa.hugepages2Mi); remove it here" $role $kind $owned) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $r.autoscaling.enabled -}}
{{- if gt (int $r.autoscaling.minReplicas) (int $r.autoscaling.maxReplicas) -}}
{{- fail (printf "%s.autoscaling.minReplicas: %d is above %s.autoscaling.maxReplicas (%d)" $role (int $r.autoscaling.minReplicas) $role (int $r.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- $queue := gt (int $r.autoscaling.targetWaitingPerReplica) 0 -}}
{{- if and (eq $r.autoscaling.kind "hpa") (not $queue) (empty $r.autoscaling.metrics) -}}
{{- fail (printf "%s.autoscaling.targetWaitingPerReplica: set it (or give %s.autoscaling.metrics) for kind=hpa; CPU says little about a GPU engine's load" $role $role) -}}
{{- end -}}
{{- if and (eq $r.autoscaling.kind "keda") (not $queue) (empty $r.autoscaling.kedaTriggers) -}}
{{- fail (printf "%s.autoscaling.targetWaitingPerReplica: set it (or give %s.autoscaling.kedaTriggers) for kind=keda" $role $role) -}}
{{- end -}}
{{- if and (eq $r.autoscaling.kind "keda") $queue (not $v.metrics.prometheusUrl) -}}
{{- fail (printf "metrics.prometheusUrl: %s.autoscaling.targetWaitingPerReplica makes a KEDA prometheus trigger, which needs the Prometheus to query" $role) -}}
{{- end -}}
{{- if and $queue (not $v.metrics.podMonitor.enabled) -}}
{{- fail (printf "metrics.podMonitor.enabled: %s.autoscaling.targetWaitingPerReplica scales on the engines' scraped vllm:num_requests_waiting, which only the chart's PodMonitor labels with namespace, release and component" $role) -}}
{{- end -}}
{{- /* KEDA's fallback (v2.20.2, apis/keda/v1alpha1 CheckFallbackValid and pkg/fallback): only KEDA
has one; it needs a trigger that is neither cpu nor memory; the HPA clamps its replicas to the
bounds, so a count outside them would silently not be what runs. */ -}}
{{- $fallback := int $r.autoscaling.keda.fallback.replicas -}}
{{- if $fallback -}}
{{- if ne $r.autoscaling.kind "keda" -}}
{{- fail (printf "%s.autoscaling.keda.fallback.replicas: a fallback is KEDA's (%s.autoscaling.kind: keda); the HPA keeps its replicas while its metrics fail. Set it to 0 or use kind keda" $role $role) -}}
{{- end -}}
{{- if or (lt $fallback (int $r.autoscaling.minReplicas)) (gt $fallback (int $r.autoscaling.maxReplicas)) -}}
{{- fail (printf "%s.autoscaling.keda.fallback.replicas: %d is outside %s.autoscaling.minReplicas..maxReplicas (%d..%d); the HPA would clamp it" $role $fallback $role (int $r.autoscaling.minReplicas) (int $r.autoscaling.maxReplicas)) -}}
{{- end -}}
{{- $external := $queue -}}
{{- range $t := $r.autoscaling.kedaTriggers | default list -}}
{{- if not (has $t.type (list "cpu" "memory")) -}}
{{- $external = true -}}
{{- end -}}
{{- end -}}
{{- if not $external -}}
{{- fail (printf "%s.autoscaling.keda.fallback.replicas: KEDA falls back only for a trigger that is neither cpu nor memory; set %s.autoscaling.targetWaitingPerReplica or add such a trigger to %s.autoscaling.kedaTriggers" $role $role $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* A pinned zone must agree with any zone, or region (zone names are the region plus a
letter), the user pins elsewhere, under the topology.kubernetes.io labels or the legacy
failure-domain.beta.kubernetes.io ones (deprecated, still on the nodes of many clusters, with the
same names): a contradiction leaves the pods Pending. */ -}}
{{- if $v.placement.zone -}}
{{- $zone := $v.placement.zone -}}
{{- $zoneKeys := list "topology.kubernetes.io/zone" "failure-domain.beta.kubernetes.io/zone" -}}
{{- $regionKeys := list "topology.kubernetes.io/region" "failure-domain.beta.kubernetes.io/region" -}}
{{- range $key, $value := $r.nodeSelector | default dict -}}
{{- if and (has $key $zoneKeys) (ne (toString $value) $zone) -}}
{{- fail (printf "%s.nodeSelector: %s=%s contradicts placement.zone=%s" $role $key $value $zone) -}}
{{- end -}}
{{- if and (has $key $regionKeys) (not (hasPrefix (toString $value) $zone)) -}}
{{- fail (printf "%s.nodeSelector: %s=%s cannot hold placement.zone=%s" $role $key $value $zone) -}}
{{- end -}}
{{- end -}}
{{- /* Required node affinity: its terms are ORed, a term's expressions ANDed, so it contradicts
the zone when every term has an expression that excludes it. */ -}}
{{- $na := (($r.affinity | default dict).nodeAffinity | default dict).requiredDuringSchedulingIgnoredDuringExecution | default dict -}}
{{- $terms := $na.nodeSelectorTerms | default list -}}
{{- $excluding := list -}}
{{- range $term := $terms -}}
{{- $why := "" -}}
{{- range $expr := $term.matchExpressions | default list -}}
{{- $values := $expr.values | default list -}}
{{- $holds := false -}}
{{- if has $expr.key $zoneKeys -}}
{{- $holds = has $zone $values -}}
{{- end -}}
{{- range $region := ternary $values (list) (has $expr.key $regionKeys) -}}
{{- if hasPrefix (toString $region) $zone -}}
{{- $holds = true -}}
{{- end -}}
{{- end -}}
{{- if and (not $why) (or (has $expr.key $zoneKeys) (has $expr.key $regionKeys)) -}}
{{- if or (and (eq $expr.operator "In") (not $holds)) (and (eq $expr.operator "NotIn") $holds) -}}
{{- $why = printf "%s %s %v" $expr.key $expr.operator $values -}}
{{- end -}}
{{- end -}}
{{- /* The chart's node selector requires topology.kubernetes.io/zone=placement.zone, so no node it allows lacks the label. */ -}}
{{- if and (not $why) (eq $expr.key "topology.kubernetes.io/zone") (eq $expr.operator "DoesNotExist") -}}
{{- $why = printf "%s DoesNotExist" $expr.key -}}
{{- end -}}
{{- end -}}
{{- if $why -}}
{{- $excluding = append $excluding $why -}}
{{- end -}}
{{- end -}}
{{- if and $terms (eq (len $excluding) (len $terms)) -}}
{{- fail (printf "%s.affinity: its required node affinity (%s) excludes placement.zone=%s" $role (join "; " $excluding) $zone) -}}
{{- end -}}
{{- end -}}
{{- end -}}

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


{{/*
Ports (templates/_ports.tpl): a per-rank port past 65535, or two ports of one pod on the same
number, in the pods that render (pd-inference.engineRoles and the router). Checked for both
connectors, the metrics proxy and the KV-cache event ports included, so that switching any of them
later cannot collide.
*/}}
{{- define "pd-inference.validate.ports" -}}
{{- $v := .Values -}}
{{- $current := $v.kvTransfer.connector -}}
{{- range $connector := list $current (ternary "nixl" "lmcache" (eq $current "lmcache")) -}}
{{- $mode := ternary "" (printf " with kvTransfer.connector %s" $connector) (eq $connector $current) -}}
{{- range $component := append (include "pd-inference.engineRoles" $ | fromJsonArray) "router" -}}
{{- $ports := include "pd-inference.ports" (dict "ctx" $ "component" $component "connector" $connector "metricsProxy" true "kvEvents" true) | fromJsonArray -}}
{{- $last := dict -}}
{{- range $p := $ports -}}
{{- if hasKey $p "rank" -}}
{{- $_ := set $last $p.field (int $p.port) -}}
{{- end -}}
{{- end -}}
{{- range $p := $ports -}}
{{- if gt (int $p.port) 65535 -}}
{{- fail (printf "%s: with %s.tensorParallelSize %d the last rank's port would be %d, above 65535" $p.field $component (int (get $v $component).tensorParallelSize) (int (get $last $p.field))) -}}
{{- end -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $p := $ports -}}
{{- if not (hasKey $p "endPort") -}}
{{- $rank := ternary (printf " (TP rank %d)" (int $p.rank)) "" (hasKey $p "rank") -}}
{{- $what := printf "%s%s" $p.field $rank -}}
{{- with get $seen (toString (int $p.port)) -}}
{{- fail (printf "%s and %s: both are port %d in the %s pods%s; each needs a port of its own" . $what (int $p.port) $component $mode) -}}
{{- end -}}
{{- $_ := set $seen (toString (int $p.port)) $what -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A Gateway API duration (1h30m, 90s, 500ms) in milliseconds. */}}
{{- define "pd-inference.gatewayDurationMs" -}}
{{- $ms := 0 -}}
{{- range $part := regexFindAll "[0-9]+(ms|h|m|s)" . -1 -}}
{{- $n := regexFind "^[0-9]+" $part | int64 -}}
{{- $unit := regexFind "[a-z]+$" $part -}}
{{- $ms = add $ms (mul $n (get (dict "h" 3600000 "m" 60000 "s" 1000 "ms" 1) $unit)) -}}
{{- end -}}
{{- $ms -}}
{{- end -}}
