{{/*
Multi-node engines (<role>.nodes > 1): each engine is one LeaderWorkerSet group of `nodes` pods
(leaderworkerset.x-k8s.io/v1; the LWS controller, checked against v0.9.0, must be installed).
Call each with (dict "ctx" $ "role" "prefill").
*/}}

{{/* "true" when the role's engines span more than one node. */}}
{{- define "pd-inference.engine.multiNode" -}}
{{- if gt (int ((get .ctx.Values .role).nodes | default 1)) 1 -}}true{{- end -}}
{{- end -}}

{{/*
The LeaderWorkerSet's name: not the role's Service name (<fullname>-<role>), which stays the
router's discovery Service of leaders only. LWS makes a headless Service of its own name that
publishes not-ready pods: the workers reach their leader by it (LWS_LEADER_ADDRESS) before the
leader is Ready, which it only becomes once they have joined. A StatefulSet of the same role
keeps its own name, so a change of nodes replaces one by the other (README, "Multi-node engines").
*/}}
{{- define "pd-inference.engine.groupName" -}}
{{- printf "%s-lws" (include "pd-inference.componentName" (dict "ctx" .ctx "component" .role)) -}}
{{- end -}}

{{/* The label LWS gives a group's pods by their place in it: "0" is the leader. */}}
{{- define "pd-inference.engine.workerIndexLabel" -}}leaderworkerset.sigs.k8s.io/worker-index{{- end -}}

{{/* What the workloads of a role are: the kind and name autoscalers target. */}}
{{- define "pd-inference.engine.scaleTarget" -}}
{{- if include "pd-inference.engine.multiNode" . -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
name: {{ include "pd-inference.engine.groupName" . }}
{{- else -}}
apiVersion: apps/v1
kind: StatefulSet
name: {{ include "pd-inference.componentName" (dict "ctx" .ctx "component" .role) }}
{{- end -}}
{{- end -}}

{{/*
A NetworkPolicy rule between a multi-node role's own pods (with "direction" "from" for ingress,
"to" for egress): a group's torch.distributed store (--master-port), NCCL's bootstrap and its
sockets, vLLM's data-parallel RPC and message queues pick ports of their own, TCP on any port.
The role's pods, not only a group's: a group's key is LWS's, unknown when rendering.
Nothing for a one-node role.
*/}}
{{- define "pd-inference.engine.groupRule" -}}
{{- if include "pd-inference.engine.multiNode" . -}}
# The pods of one multi-node engine among themselves (torch.distributed, NCCL, vLLM's data-parallel sockets).
- {{ .direction }}:
    - podSelector:
        matchLabels:
          {{- include "pd-inference.selectorLabels" (dict "ctx" .ctx "component" .role) | nindent 10 }}
  ports:
    - protocol: TCP
      port: 1
      endPort: 65535
{{- end -}}
{{- end -}}
