{{/* Each engine role that renders: its flags and env, KV events, drain, parallelism, placement, accelerators, autoscaling. Included by pd-inference.validate (templates/_validate.tpl), in its order. */}}

{{- define "pd-inference.validate.roles" -}}
{{- $v := .Values -}}
{{- $connector := include "pd-inference.connector" . | fromJson -}}
{{- $instanceTypes := include "pd-inference.instanceTypes" . | fromYaml -}}
{{- /* The roles that render: what is not rendered needs no check. */ -}}
{{- range $role := include "pd-inference.engineRoles" . | fromJsonArray -}}
{{- $r := get $v $role -}}
{{- /* Flags and environment variables the chart sets (templates/engine/_args.tpl). vLLM
accepts --a-b, --a_b, --a-b=v and -tp for --tensor-parallel-size. */ -}}
{{- $flags := dict "host" "the chart (0.0.0.0)" "port" "ports.engineHttp" "served-model-name" "model.servedName" "revision" "model.revision" "tensor-parallel-size" (printf "%s.tensorParallelSize" $role) "max-model-len" "model.maxModelLen" "gpu-memory-utilization" (printf "%s.gpuMemoryUtilization" $role) "shutdown-timeout" (printf "%s.drainSeconds" $role) "kv-transfer-config" "kvTransfer" "model" "model.name" "reasoning-parser" "model.reasoningParser" "enable-auto-tool-choice" "model.toolCallParser" "tool-call-parser" "model.toolCallParser" -}}
{{- range $flag := list "enable-lora" "max-loras" "max-cpu-loras" "max-lora-rank" "lora-modules" -}}
{{- $_ := set $flags $flag "model.lora" -}}
{{- end -}}
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
{{- fail (printf "chart bug: engine flag --%s has no owner in templates/validate/_engines.tpl" $n) -}}
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
{{- if and $connector.oneRankEngines (or (gt $nodes 1) (gt $dp 1)) -}}
{{- fail (printf "%s: kvTransfer.connector %s serves one-node engines of one data-parallel rank: %s; use kvTransfer.connector: %s" (ternary (printf "%s.nodes" $role) (printf "%s.dataParallelSize" $role) (gt $nodes 1)) $connector.name $connector.oneRankEngines (include "pd-inference.connectorsWhere" (dict "ctx" $ "fact" "oneRankEngines" "set" false))) -}}
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
{{- end -}}
