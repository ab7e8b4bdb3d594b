{{/*
An engine pod's template (metadata and spec), one for every shape: (dict "ctx" $ "role" "prefill"
"member" "single"), the StatefulSet's pod of a one-node engine; "leader" and "worker", the pods of
a multi-node engine's LeaderWorkerSet group (engine/leaderworkerset.yaml). A leader is a single
pod plus the multi-node flags; a worker runs vLLM headless: no API, so no probes on it, no
preStop wait, no sidecars.
*/}}
{{- define "pd-inference.engine.podTemplate" -}}
{{- $role := .role }}
{{- $v := .ctx.Values }}
{{- $r := get $v $role }}
{{- $ := .ctx }}
{{- $ctx := dict "ctx" $ "component" $role }}
{{- $worker := eq .member "worker" -}}
{{- $pod := dict "ctx" $ "role" $role "member" .member -}}
metadata:
  labels:
    {{- include "pd-inference.podLabels" $ctx | nindent 4 }}
    pd-inference.io/kv-revision: {{ include "pd-inference.kvRevision" $ | quote }}
    {{- with $r.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include "pd-inference.engine.configChecksum" $pod }}
    {{- with $r.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "pd-inference.engineServiceAccountName" $ }}
  automountServiceAccountToken: false
  # The preStop wait, vLLM's drain and its teardown (engine.drain, _pod.tpl); _validate.tpl checks the sum.
  terminationGracePeriodSeconds: {{ $r.terminationGracePeriodSeconds }}
  {{- with include "pd-inference.podScheduling" $r | trim }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  securityContext:
    {{- toYaml $v.engine.podSecurityContext | nindent 4 }}
  containers:
    - name: vllm
      image: {{ include "pd-inference.engine.image" $pod | quote }}
      imagePullPolicy: {{ $v.engine.image.pullPolicy }}
      {{- if $v.engine.preflight.enabled }}
      # The preflight checks this image can run the configured KV hand-off, then execs vLLM.
      command:
        - {{ $v.engine.preflight.python }}
        - {{ include "pd-inference.preflightDir" $ }}/preflight.py
        - --connector={{ $v.kvTransfer.connector }}
        - --backend={{ include "pd-inference.nixlBackend" $ }}
        - --buffer-device={{ (get $v.kvTransfer $v.kvTransfer.connector).bufferDevice }}
        - --buffer-field=kvTransfer.{{ $v.kvTransfer.connector }}.bufferDevice
        - --efa-devices={{ ternary (int $v.efa.devices) 0 $v.efa.enabled }}
        {{- if include "pd-inference.lmcacheMp" $ }}
        - --lmcache-mp
        {{- end }}
        - --checked-vllm={{ index $.Chart.Annotations "pd-inference.io/checked-vllm" }}
        - --timeout-seconds={{ $v.engine.preflight.timeoutSeconds }}
        {{- range $i, $a := $v.model.lora.adapters }}
        {{- with $a.hub }}
        - --lora-hub=model.lora.adapters[{{ $i }}].hub={{ .id }}@{{ .revision }}
        {{- end }}
        {{- end }}
        - --
        - vllm
        - serve
      {{- else }}
      command: [vllm, serve]
      {{- end }}
      args:
        {{- include "pd-inference.engineArgs" $pod | nindent 8 }}
        {{- range $r.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        {{- include "pd-inference.engine.env" $pod | nindent 8 }}
      {{- if not $worker }}
      ports:
        {{- include "pd-inference.containerPorts" (dict "ctx" $ "component" $role "container" "vllm") | nindent 8 }}
      startupProbe:
        httpGet:
          path: /health
          port: http
        {{- toYaml $v.engine.probes.startup | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /health
          port: http
        {{- toYaml $v.engine.probes.readiness | nindent 8 }}
      livenessProbe:
        httpGet:
          path: /health
          port: http
        {{- toYaml $v.engine.probes.liveness | nindent 8 }}
      # Keep serving until every router has stopped sending here; SIGTERM comes after it.
      lifecycle:
        {{- include "pd-inference.preStopWait" (dict "python" $v.engine.preflight.python "seconds" (include "pd-inference.engine.preStopSeconds" $)) | nindent 8 }}
      {{- end }}
      resources:
        {{- include "pd-inference.engine.resources" $pod | nindent 8 }}
      securityContext:
        {{- if $v.efa.privileged }}
        # Opted in with efa.privileged: some NIXL/EFA setups need it to register GPU memory.
        privileged: true
        {{- else }}
        privileged: false
        allowPrivilegeEscalation: false
        capabilities:
          drop: [ALL]
          {{- if $v.efa.enabled }}
          # Pinning (mlock) memory for RDMA registration.
          add: [IPC_LOCK]
          {{- end }}
        {{- end }}
        readOnlyRootFilesystem: {{ $v.engine.readOnlyRootFilesystem }}
        runAsNonRoot: true
      volumeMounts:
        {{- include "pd-inference.engine.volumeMounts" $pod | nindent 8 }}
    {{- if and (eq $role "prefill") (include "pd-inference.notificationSidecar" $) (not $worker) }}
    # Receives this pod's LMCache "KV landed" notifications (ZMQ PULL on 127.0.0.1) and answers
    # the router's "has request X landed?" over HTTP, so router replicas need no shared state.
    - name: notify-sidecar
      image: {{ include "pd-inference.helperImage" $ | quote }}
      imagePullPolicy: {{ $v.engine.helperImage.pullPolicy }}
      args:
        - notify-sidecar
        - --host=0.0.0.0
        - --port={{ include "pd-inference.port" (dict "ctx" $ "component" $role "name" "notify-sidecar") }}
        - --zmq-bind=tcp://127.0.0.1:{{ include "pd-inference.port" (dict "ctx" $ "component" $role "name" "notify-zmq") }}
      ports:
        {{- include "pd-inference.containerPorts" (dict "ctx" $ "component" $role "container" "notify-sidecar") | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /health
          port: notify-sidecar
        periodSeconds: 10
      livenessProbe:
        httpGet:
          path: /health
          port: notify-sidecar
        periodSeconds: 15
        failureThreshold: 4
      # Up as long as vLLM serves: the router asks it about the prefills vLLM still drains. With
      # the helper image's Python (python3 of its virtualenv, on PATH).
      lifecycle:
        {{- include "pd-inference.preStopWait" (dict "python" "python3" "seconds" (include "pd-inference.engine.preStopSeconds" $) "untilClosed" (include "pd-inference.port" (dict "ctx" $ "component" $role "name" "http")) "atMost" (add (include "pd-inference.engine.preStopSeconds" $ | int) (int $r.drainSeconds))) | nindent 8 }}
      resources:
        {{- toYaml $v.kvTransfer.lmcache.sidecar.resources | nindent 8 }}
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        runAsNonRoot: true
        capabilities:
          drop: [ALL]
    {{- end }}
    {{- if and (include "pd-inference.lmcacheMp" $) (not $worker) }}
    {{- include "pd-inference.engine.lmcacheServer" $pod | nindent 4 }}
    {{- end }}
    {{- if and $v.engine.metricsProxy.enabled (not $worker) }}
    # vLLM serves /metrics on its API port and a NetworkPolicy cannot filter paths: Prometheus
    # scrapes this metrics-only proxy instead, so networkPolicy.metricsFrom reaches no API.
    - name: metrics-proxy
      image: {{ include "pd-inference.helperImage" $ | quote }}
      imagePullPolicy: {{ $v.engine.helperImage.pullPolicy }}
      args:
        - metrics-proxy
        - --host=0.0.0.0
        - --port={{ include "pd-inference.port" (dict "ctx" $ "component" $role "name" "metrics") }}
        - --upstream=http://127.0.0.1:{{ include "pd-inference.port" (dict "ctx" $ "component" $role "name" "http") }}
      ports:
        {{- include "pd-inference.containerPorts" (dict "ctx" $ "component" $role "container" "metrics-proxy") | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /health
          port: metrics
        periodSeconds: 10
      livenessProbe:
        httpGet:
          path: /health
          port: metrics
        periodSeconds: 15
        failureThreshold: 4
      resources:
        {{- toYaml $v.engine.metricsProxy.resources | nindent 8 }}
      securityContext:
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        runAsNonRoot: true
        capabilities:
          drop: [ALL]
    {{- end }}
  volumes:
    {{- include "pd-inference.engine.volumes" $pod | nindent 4 }}
  {{- with include "pd-inference.engine.nodeSelector" $pod }}
  nodeSelector:
    {{- . | nindent 4 }}
  {{- end }}
  {{- with $r.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "pd-inference.engine.affinity" $pod }}
  affinity:
    {{- . | nindent 4 }}
  {{- end }}
  {{- if ne $r.spreadAcrossNodes "none" }}
  topologySpreadConstraints:
    - maxSkew: 1
      topologyKey: kubernetes.io/hostname
      whenUnsatisfiable: {{ ternary "DoNotSchedule" "ScheduleAnyway" (eq $r.spreadAcrossNodes "required") }}
      labelSelector:
        matchLabels:
          {{- include "pd-inference.selectorLabels" $ctx | nindent 10 }}
  {{- end }}
{{- end -}}
