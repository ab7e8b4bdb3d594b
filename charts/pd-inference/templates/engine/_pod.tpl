{{/*
The computed fragments of an engine pod (argo-cd's `argo-cd.affinity` style): what the chart adds
to the user's values. templates/engine/statefulset.yaml keeps only the pod's shape. Each takes
(dict "ctx" $ "role" "prefill").
*/}}

{{/* A checksum of what the engine reads at start (KV hand-off config, LMCache config, preflight), so a change rolls the pods. */}}
{{- define "pd-inference.engine.configChecksum" -}}
{{- $v := .ctx.Values -}}
{{- $lmcache := eq $v.kvTransfer.connector "lmcache" -}}
{{- printf "%s\n%s\n%s" (include "pd-inference.kvTransferConfig" .) (ternary (include "pd-inference.lmcacheConfig" .) "" $lmcache) (ternary (.ctx.Files.Get "files/preflight.py") "" $v.engine.preflight.enabled) | sha256sum -}}
{{- end -}}

{{/*
The drain (engine.drain, <role>.drainSeconds, <role>.terminationGracePeriodSeconds). When a pod is
deleted, the EndpointSlice controller marks it not ready at once, and the headless Service
(publishNotReadyAddresses: false) stops answering with it; each router drops it at its next
re-resolution, up to router.discoveryRefreshSeconds later, once the cluster DNS's cached answers
(engine.drain.dnsCacheSeconds) have expired. The preStop hook keeps vLLM serving that long, from
the one interval the router config renders, so no router sends to an engine that got SIGTERM;
then vLLM drains (its --shutdown-timeout, <role>.drainSeconds). _validate.tpl refuses a grace
period that does not cover both. Takes the root context.
*/}}
{{- define "pd-inference.engine.preStopSeconds" -}}
{{- add (int .Values.router.discoveryRefreshSeconds) (int .Values.engine.drain.dnsCacheSeconds) -}}
{{- end -}}

{{/*
The preStop wait as an exec of the image's own Python (engine.preflight.python, which vLLM runs
in): no shell and no sleep binary needed. Not the kubelet's `sleep` action: the chart supports
Kubernetes 1.29 (Chart.yaml kubeVersion), where PodLifecycleSleepAction is alpha and off by default
(beta from 1.30, GA in 1.34: k8s.io/kubernetes v1.34.0 pkg/features/kube_features.go), and there
the API server drops the field and refuses the empty handler ("must specify a handler type":
pkg/api/pod/util.go dropPodLifecycleSleepAction, then validation). Choosing by
.Capabilities.KubeVersion instead would make what CI renders (at the minimum version) differ from
what Argo CD applies on a newer cluster. Move to `sleep: {seconds: N}` once kubeVersion >= 1.30.
Call with (dict "python" <interpreter> "seconds" N); with "untilClosed" PORT and "atMost" M it
then waits on, until nothing listens on 127.0.0.1:PORT any more (vLLM's HTTP server closes when its
drain is over) or M seconds after the hook began.
*/}}
{{- define "pd-inference.preStopWait" -}}
preStop:
  exec:
    command:
      - {{ .python }}
      - -c
      {{- if .untilClosed }}
      - {{ printf "import socket, time\nend = time.monotonic() + %d\ntime.sleep(%d)\nwhile time.monotonic() < end:\n    try:\n        socket.create_connection((\"127.0.0.1\", %d), 1).close()\n    except OSError:\n        break\n    time.sleep(1)" (int .atMost) (int .seconds) (int .untilClosed) | quote }}
      {{- else }}
      - import time; time.sleep({{ .seconds }})
      {{- end }}
{{- end -}}

{{/* The engine container's image. */}}
{{- define "pd-inference.engine.image" -}}
{{- include "pd-inference.image" (dict "image" .ctx.Values.engine.image "default" .ctx.Values.engine.image.tag) -}}
{{- end -}}

{{/* The engine container's environment: the chart's (pd-inference.engineEnv), then engine.env, then <role>.env. */}}
{{- define "pd-inference.engine.env" -}}
{{- $v := .ctx.Values -}}
{{- include "pd-inference.engineEnv" . }}
{{- with $v.engine.env }}
{{ toYaml . }}
{{- end }}
{{- with (get $v .role).env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Resources: <role>.resources plus what the chart owns (_validate.tpl refuses them in the values):
the pod's share of its engine's GPUs (gpusPerPod), and with EFA the devices and the huge pages.
*/}}
{{- define "pd-inference.engine.resources" -}}
{{- $v := .ctx.Values -}}
{{- $r := get $v .role -}}
{{- $gpus := include "pd-inference.engine.gpusPerPod" $r | int -}}
{{- $res := deepCopy ($r.resources | default dict) -}}
{{- $req := get $res "requests" | default dict -}}
{{- $lim := get $res "limits" | default dict -}}
{{- $_ := set $req "nvidia.com/gpu" $gpus -}}
{{- $_ := set $lim "nvidia.com/gpu" $gpus -}}
{{- if $v.efa.enabled -}}
{{- $_ := set $req "vpc.amazonaws.com/efa" (int $v.efa.devices) -}}
{{- $_ := set $lim "vpc.amazonaws.com/efa" (int $v.efa.devices) -}}
{{- $_ := set $req "hugepages-2Mi" $v.efa.hugepages2Mi -}}
{{- $_ := set $lim "hugepages-2Mi" $v.efa.hugepages2Mi -}}
{{- end -}}
requests:
  {{- toYaml $req | nindent 2 }}
limits:
  {{- toYaml $lim | nindent 2 }}
{{- end -}}

{{/* Node selector: <role>.nodeSelector plus the instance type and the pinned zone. Empty when none. */}}
{{- define "pd-inference.engine.nodeSelector" -}}
{{- $v := .ctx.Values -}}
{{- $r := get $v .role -}}
{{- $nodeSelector := deepCopy ($r.nodeSelector | default dict) -}}
{{- if $r.instanceType -}}
{{- $_ := set $nodeSelector "node.kubernetes.io/instance-type" $r.instanceType -}}
{{- end -}}
{{- if $v.placement.zone -}}
{{- $_ := set $nodeSelector "topology.kubernetes.io/zone" $v.placement.zone -}}
{{- end -}}
{{- with $nodeSelector -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}

{{/*
Affinity: <role>.affinity plus, with placement.sameZone (and no pinned zone), a required pod
affinity to the zone of the first engine role (pd-inference.engineRoles). Split: prefillers follow
each other (a required self-affinity lets the first one land anywhere), decoders follow the
prefillers. Mutual required affinity between the roles would deadlock: neither could be scheduled
first. Flexible: the decoders, the only role, follow each other. Empty when none.
*/}}
{{- define "pd-inference.engine.affinity" -}}
{{- $v := .ctx.Values -}}
{{- $affinity := deepCopy ((get $v .role).affinity | default dict) -}}
{{- if and $v.placement.sameZone (not $v.placement.zone) -}}
{{- $podAffinity := get $affinity "podAffinity" | default dict -}}
{{- $terms := get $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default list -}}
{{- $anchor := first (include "pd-inference.engineRoles" .ctx | fromJsonArray) -}}
{{- $anchorSelector := include "pd-inference.selectorLabels" (dict "ctx" .ctx "component" $anchor) | fromYaml -}}
{{- $terms = append $terms (dict "topologyKey" "topology.kubernetes.io/zone" "labelSelector" (dict "matchLabels" $anchorSelector)) -}}
{{- $_ := set $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" $terms -}}
{{- $_ := set $affinity "podAffinity" $podAffinity -}}
{{- end -}}
{{- with $affinity -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}

{{/* The engine container's volume mounts, the chart's then engine.extraVolumeMounts. */}}
{{- define "pd-inference.engine.volumeMounts" -}}
{{- $v := .ctx.Values -}}
- name: dshm
  mountPath: /dev/shm
- name: model-cache
  mountPath: {{ $v.modelCache.mountPath }}
- name: tmp
  mountPath: /tmp
{{- if eq $v.kvTransfer.connector "lmcache" }}
- name: lmcache-config
  mountPath: /etc/lmcache
  readOnly: true
{{- end }}
{{- if $v.engine.preflight.enabled }}
- name: preflight
  mountPath: {{ include "pd-inference.preflightDir" .ctx }}
  readOnly: true
{{- end }}
{{- if $v.model.hfTokenSecret.name }}
- name: hf-token
  mountPath: {{ include "pd-inference.hfTokenDir" .ctx }}
  readOnly: true
{{- end }}
{{- with $v.engine.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The engine pod's volumes (the model cache of `modelCache.type: pvc` is a claim template instead), then engine.extraVolumes. */}}
{{- define "pd-inference.engine.volumes" -}}
{{- $v := .ctx.Values -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ (get $v .role).shmSize }}
- name: tmp
  emptyDir:
    sizeLimit: 20Gi
{{- if eq $v.modelCache.type "hostPath" }}
- name: model-cache
  hostPath:
    path: {{ $v.modelCache.hostPath.path }}
    type: {{ $v.modelCache.hostPath.type }}
{{- else if eq $v.modelCache.type "emptyDir" }}
- name: model-cache
  emptyDir:
    {{- with $v.modelCache.emptyDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- if eq $v.kvTransfer.connector "lmcache" }}
- name: lmcache-config
  configMap:
    name: {{ include "pd-inference.componentName" (dict "ctx" .ctx "component" .role) }}-lmcache
{{- end }}
{{- if $v.engine.preflight.enabled }}
- name: preflight
  configMap:
    name: {{ include "pd-inference.componentName" (dict "ctx" .ctx "component" "engine") }}-preflight
{{- end }}
{{- if $v.model.hfTokenSecret.name }}
- name: hf-token
  secret:
    secretName: {{ $v.model.hfTokenSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ $v.model.hfTokenSecret.key }}
        path: {{ include "pd-inference.hfTokenFileName" .ctx }}
{{- end }}
{{- with $v.engine.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The model-cache claim of modelCache.type pvc, one per engine pod: a StatefulSet's or a LeaderWorkerSet's volumeClaimTemplates. */}}
{{- define "pd-inference.engine.modelCacheClaims" -}}
{{- $pvc := .Values.modelCache.pvc -}}
- metadata:
    name: model-cache
  spec:
    accessModes:
      {{- toYaml $pvc.accessModes | nindent 6 }}
    {{- with $pvc.storageClassName }}
    storageClassName: {{ . }}
    {{- end }}
    resources:
      requests:
        storage: {{ $pvc.size }}
{{- end -}}

{{/* GPUs of one engine pod, from a role's values: tensorParallelSize x dataParallelSize over nodes (_validate.tpl refuses a remainder). */}}
{{- define "pd-inference.engine.gpusPerPod" -}}
{{- div (mul (int .tensorParallelSize) (int (.dataParallelSize | default 1))) (int (.nodes | default 1)) -}}
{{- end -}}

{{/*
The LMCache MP server of an engine pod (kvTransfer.nixl.lmcacheMp): `lmcache server` of the
engine image's LMCache (LMCache 0.5.6: lmcache/cli/commands/server.py runs
lmcache.v1.multiprocess.http_server, started here as that module with the image's Python, so no
console script on PATH is assumed). Its requests on 127.0.0.1 (only this pod's vLLM), its HTTP
API on 127.0.0.1 too: it can clear the cache and attach storage, unauthenticated, so nothing
outside the pod may reach it, NetworkPolicy or not; the kubelet's probes ask it from inside (an
exec of the image's Python): `/` answers once it serves (`/healthcheck` waits for an engine to
attach, which would hold a startup probe). No GPU visible (NVIDIA_VISIBLE_DEVICES void): CUDA
images set it to all, and where nvidia is the node's default runtime a container that asks for
no GPU would still see every one, and LMCache would open a CUDA context beside vLLM's. `--disable-metrics`: its Prometheus
port is not in the chart's port model; vLLM's own metrics count what the connector loads
(`vllm:prompt_tokens_by_source_total`). The KV it keeps is CPU memory of this container, its
request and limit `l1SizeGiB` + `overheadGiB`. Transfers engine-driven (LMCache 0.5.6
v1/multiprocess/transfer_mode.py): vLLM's worker copies KV between its device and CPU buffers
and sends them over the ZMQ socket (no --shm-name), so this container needs no GPU and the two
containers share no memory; the zero-copy lmcache_driven mode, LMCache's default on CUDA, maps
the engine's GPU memory over CUDA IPC and needs the node's GPUs visible here (LMCache's
docs/mp/deployment), and a --shm-name pool needs a /dev/shm as large as the L1, which a
memory-backed emptyDir counts against the pod's memory. Up until vLLM's API closes, as the other helpers:
vLLM drains with its connector attached. (dict "ctx" $ "role" "prefill").
*/}}
{{- define "pd-inference.engine.lmcacheServer" -}}
{{- $v := .ctx.Values -}}
{{- $mp := $v.kvTransfer.nixl.lmcacheMp -}}
{{- $r := get $v .role -}}
{{- $memory := printf "%dGi" (add (int $mp.l1SizeGiB) (int $mp.overheadGiB)) -}}
{{- $stop := include "pd-inference.engine.preStopSeconds" .ctx -}}
- name: lmcache-server
  image: {{ include "pd-inference.engine.image" . | quote }}
  imagePullPolicy: {{ $v.engine.image.pullPolicy }}
  command:
    - {{ $v.engine.preflight.python }}
    - -m
    - lmcache.v1.multiprocess.http_server
  args:
    {{- include "pd-inference.engine.lmcacheServerArgs" . | nindent 4 }}
  env:
    {{- include "pd-inference.engine.cacheEnv" . | nindent 4 }}
    - name: NVIDIA_VISIBLE_DEVICES
      value: void
    - name: CUDA_VISIBLE_DEVICES
      value: ""
  startupProbe:
    exec:
      command: {{ include "pd-inference.engine.lmcacheProbe" . }}
    periodSeconds: 5
    timeoutSeconds: 10
    failureThreshold: 60
  livenessProbe:
    exec:
      command: {{ include "pd-inference.engine.lmcacheProbe" . }}
    periodSeconds: 15
    timeoutSeconds: 10
    failureThreshold: 4
  lifecycle:
    {{- include "pd-inference.preStopWait" (dict "python" $v.engine.preflight.python "seconds" $stop "untilClosed" (include "pd-inference.port" (dict "ctx" .ctx "component" .role "name" "http")) "atMost" (add ($stop | int) (int $r.drainSeconds))) | nindent 4 }}
  resources:
    requests:
      cpu: {{ $mp.cpu | quote }}
      memory: {{ $memory }}
    limits:
      memory: {{ $memory }}
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: {{ $v.engine.readOnlyRootFilesystem }}
    runAsNonRoot: true
    capabilities:
      drop: [ALL]
  volumeMounts:
    - name: tmp
      mountPath: /tmp
{{- end -}}

{{/* The LMCache MP server's probe: its `/` on 127.0.0.1, with the image's Python, as a JSON list. (dict "ctx" $ "role" "prefill"). */}}
{{- define "pd-inference.engine.lmcacheProbe" -}}
{{- $port := include "pd-inference.port" (dict "ctx" .ctx "component" .role "name" "lmcache-http") -}}
{{- list .ctx.Values.engine.preflight.python "-c" (printf "import urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/', timeout=8)" $port) | toJson -}}
{{- end -}}

{{/* The LMCache MP server's arguments (LMCache 0.5.6 `lmcache server --help`; tests/engines/ parses them with that package's own parser). (dict "ctx" $ "role" "prefill"). */}}
{{- define "pd-inference.engine.lmcacheServerArgs" -}}
{{- $v := .ctx.Values -}}
{{- $mp := $v.kvTransfer.nixl.lmcacheMp -}}
- --host=127.0.0.1
- --port={{ include "pd-inference.port" (dict "ctx" .ctx "component" .role "name" "lmcache-mp") }}
- --http-host=127.0.0.1
- --http-port={{ include "pd-inference.port" (dict "ctx" .ctx "component" .role "name" "lmcache-http") }}
- --l1-size-gb={{ $mp.l1SizeGiB }}
- --eviction-policy={{ $mp.evictionPolicy }}
- --chunk-size={{ $mp.chunkSize }}
- --supported-transfer-mode=engine_driven
- --disable-metrics
{{- end -}}
