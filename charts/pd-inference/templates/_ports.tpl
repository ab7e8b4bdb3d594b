{{/*
ONE port model: every port a component's pods listen on, in the order containers, Services and
NetworkPolicies list them. Container ports, Service ports, NetworkPolicy ingress and egress rules,
the router config, the LMCache configs, the engine command lines and the collision check in
_validate.tpl all take their ports from here; no other template derives a port from `ports.*`
but the connectors' own pieces this model calls (templates/_connectors.tpl).

Call with (dict "ctx" $ "component" "decode"); returns a JSON list of
  name         port name, as containers and Services call it (at most 15 characters)
  port         the number; endPort: the last one of a range (NetworkPolicies only)
  field        the value it comes from (ports.lmcacheInitBase); rank: the TP rank of a per-rank port
  container    the container that declares it; "" = bound but not declared (127.0.0.1 only)
  service      whether the component's Service exposes it; servicePort: that port when not `port`
  from         who may connect: components (router, prefill, decode, helm-test), values holding
               NetworkPolicyPeer lists (networkPolicy.metricsFrom), or "any"; empty = nobody
  doc          the comment of its NetworkPolicy rule; consecutive ports with the same doc and
               peers share one rule. serviceDoc: a comment on its Service port
Optional keys give the ports of another mode: "connector" (a name of templates/_connectors.tpl),
"receiver" (the LMCache notification receiver, router | prefillSidecar), "metricsProxy" (true |
false), "kvEvents" (true | false, engine.kvEvents.enabled) and "lmcacheMp" (true | false, the
LMCache MP server of kvTransfer.nixl.lmcacheMp). The router config names the ports
of every mode, and _validate.tpl checks every connector, with the metrics proxy and the KV events on.
A connector's own ports come from its piece pd-inference.connectors.<name>.ports, after the
component's API, metrics and KV-event ports.
*/}}
{{- define "pd-inference.ports" -}}
{{- $v := .ctx.Values -}}
{{- $c := .component -}}
{{- $connector := .connector | default $v.kvTransfer.connector -}}
{{- $lmcacheMp := ternary .lmcacheMp (not (empty (include "pd-inference.lmcacheMp" .ctx))) (hasKey . "lmcacheMp") -}}
{{- $own := dict "ctx" .ctx "component" $c "receiver" (.receiver | default "") "lmcacheMp" $lmcacheMp -}}
{{- $proxy := ternary .metricsProxy $v.engine.metricsProxy.enabled (hasKey . "metricsProxy") -}}
{{- $kvEvents := ternary .kvEvents $v.engine.kvEvents.enabled (hasKey . "kvEvents") -}}
{{- $metricsFrom := $v.networkPolicy.metricsFrom -}}
{{- $p := list -}}
{{- if eq $c "router" -}}
{{- $from := list "any" -}}
{{- if $v.networkPolicy.routerIngressFrom -}}
{{- $from = list "networkPolicy.routerIngressFrom" "networkPolicy.metricsFrom" "helm-test" -}}
{{- end -}}
{{- $p = append $p (dict "name" "http" "port" (int $v.ports.routerHttp) "field" "ports.routerHttp" "container" "router" "service" true "servicePort" (int $v.router.service.port) "from" $from "doc" "Clients: the OpenAI API.") -}}
{{- $p = concat $p (include (printf "pd-inference.connectors.%s.ports" $connector) $own | fromJsonArray) -}}
{{- else -}}
{{- /* Who moves KV with this role's pods: the other role (split), or the other engines of its own
role (flexible: each prefills for another and decodes what another prefilled). */ -}}
{{- $flexible := include "pd-inference.flexible" .ctx -}}
{{- $other := ternary $c (ternary "decode" "prefill" (eq $c "prefill")) (not (empty $flexible)) -}}
{{- $otherDoc := ternary "the other engines of the pool" "the other role" (not (empty $flexible)) -}}
{{- $httpFrom := list "router" -}}
{{- $httpDoc := "The OpenAI API, from the router only." -}}
{{- if and (not $proxy) $metricsFrom -}}
{{- $httpFrom = append $httpFrom "networkPolicy.metricsFrom" -}}
{{- $httpDoc = "The OpenAI API, from the router; without the metrics proxy from networkPolicy.metricsFrom too:\nscraping /metrics opens this whole port (the engine's API)." -}}
{{- end -}}
{{- $p = append $p (dict "name" "http" "port" (int $v.ports.engineHttp) "field" "ports.engineHttp" "container" "vllm" "service" true "from" $httpFrom "doc" $httpDoc) -}}
{{- if $proxy -}}
{{- $p = append $p (dict "name" "metrics" "port" (int $v.ports.engineMetrics) "field" "ports.engineMetrics" "container" "metrics-proxy" "service" false "from" (list "networkPolicy.metricsFrom") "doc" "Prometheus: the metrics-only proxy, nothing else.") -}}
{{- end -}}
{{- /* Not on the Service: each router connects to every pod IP the headless Service's DNS gives. */ -}}
{{- if $kvEvents -}}
{{- $doc := "vLLM KV-cache events (ZMQ PUB) and their replay endpoint (ZMQ ROUTER), from the router only." -}}
{{- $p = append $p (dict "name" "kv-events" "port" (int $v.ports.kvEvents) "field" "ports.kvEvents" "container" "vllm" "service" false "from" (list "router") "doc" $doc) -}}
{{- $p = append $p (dict "name" "kv-replay" "port" (int $v.ports.kvEventsReplay) "field" "ports.kvEventsReplay" "container" "vllm" "service" false "from" (list "router") "doc" $doc) -}}
{{- end -}}
{{- $p = concat $p (include (printf "pd-inference.connectors.%s.ports" $connector) (merge (dict "other" $other "otherDoc" $otherDoc) $own) | fromJsonArray) -}}
{{- if and $v.networkPolicy.allowEphemeralKvPorts (eq (include "pd-inference.nixlBackend" .ctx) "UCX") -}}
{{- $p = append $p (dict "name" "ucx-tcp" "port" 1024 "endPort" 65535 "field" "networkPolicy.allowEphemeralKvPorts" "container" "" "service" false "from" (list $other) "doc" (printf "UCX over TCP moves KV on ephemeral ports; only %s may use them. (Not with EFA:\nLIBFABRIC's RDMA bypasses the kernel and needs no rule.)" $otherDoc)) -}}
{{- end -}}
{{- end -}}
{{- toJson $p -}}
{{- end -}}

{{/*
One port's number, by name: (dict "ctx" $ "component" "decode" "name" "http"), plus the mode keys
of pd-inference.ports; with "service" true its Service port. A name the component lacks is a chart bug.
*/}}
{{- define "pd-inference.port" -}}
{{- $found := "" -}}
{{- range $p := include "pd-inference.ports" . | fromJsonArray -}}
{{- if and (eq $p.name $.name) (eq $found "") -}}
{{- $found = toString (int (ternary ($p.servicePort | default $p.port) $p.port (and (hasKey $ "service") $.service))) -}}
{{- end -}}
{{- end -}}
{{- if eq $found "" -}}
{{- fail (printf "chart bug: the %s pods have no port %s here (templates/_ports.tpl)" .component .name) -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{/* The numbers of a component's ports from one value, JSON, e.g. the per-rank LMCache ports: (dict "ctx" $ "component" "decode" "field" "ports.lmcacheInitBase"). */}}
{{- define "pd-inference.portNumbers" -}}
{{- $out := list -}}
{{- range $p := include "pd-inference.ports" . | fromJsonArray -}}
{{- if eq $p.field $.field -}}
{{- $out = append $out (int $p.port) -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* A container's `ports:` list. Call with (dict "ctx" $ "component" "prefill" "container" "vllm"). */}}
{{- define "pd-inference.containerPorts" -}}
{{- $lines := list -}}
{{- range $p := include "pd-inference.ports" (dict "ctx" .ctx "component" .component) | fromJsonArray -}}
{{- if eq $p.container $.container -}}
{{- $lines = append $lines (printf "- name: %s\n  containerPort: %d\n  protocol: TCP" $p.name (int $p.port)) -}}
{{- end -}}
{{- end -}}
{{- join "\n" $lines -}}
{{- end -}}

{{/* A component's Service `ports:` list. Call with (dict "ctx" $ "component" "decode"). */}}
{{- define "pd-inference.servicePorts" -}}
{{- $lines := list -}}
{{- range $p := include "pd-inference.ports" . | fromJsonArray -}}
{{- if $p.service -}}
{{- with $p.serviceDoc -}}
{{- $lines = append $lines (printf "# %s" .) -}}
{{- end -}}
{{- $lines = append $lines (printf "- name: %s\n  port: %d\n  targetPort: %s\n  protocol: TCP" $p.name (int ($p.servicePort | default $p.port)) $p.name) -}}
{{- end -}}
{{- end -}}
{{- join "\n" $lines -}}
{{- end -}}

{{/* A NetworkPolicy `ports:` entry of a port of the model. */}}
{{- define "pd-inference.policyPort" -}}
- port: {{ int .port }}
{{- with .endPort }}
  endPort: {{ int . }}
{{- end }}
  protocol: TCP
{{- end -}}

{{/* A podSelector peer of a component's pods. Call with (dict "ctx" $ "component" "router"). */}}
{{- define "pd-inference.podPeer" -}}
- podSelector:
    matchLabels:
      {{- include "pd-inference.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/*
A component's NetworkPolicy ingress rules, from its ports: consecutive ports with the same doc
and peers share one rule, and a port nobody may reach (no peer, or an empty peer list) gets none.
Call with (dict "ctx" $ "component" "decode").
*/}}
{{- define "pd-inference.ingressRules" -}}
{{- $ctx := .ctx -}}
{{- $np := $ctx.Values.networkPolicy -}}
{{- $rules := list -}}
{{- range $p := include "pd-inference.ports" . | fromJsonArray -}}
{{- $open := false -}}
{{- range $peer := $p.from -}}
{{- if or (not (hasPrefix "networkPolicy." $peer)) (get $np (trimPrefix "networkPolicy." $peer)) -}}
{{- $open = true -}}
{{- end -}}
{{- end -}}
{{- if $open -}}
{{- $prev := ternary (last $rules) dict (gt (len $rules) 0) -}}
{{- if and $prev (eq (toJson $prev.from) (toJson $p.from)) (eq $prev.doc $p.doc) -}}
{{- $_ := set $prev "ports" (append $prev.ports $p) -}}
{{- else -}}
{{- $rules = append $rules (dict "doc" $p.doc "from" $p.from "ports" (list $p)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $lines := list -}}
{{- range $rule := $rules -}}
{{- range $line := splitList "\n" $rule.doc -}}
{{- $lines = append $lines (printf "# %s" $line) -}}
{{- end -}}
{{- $lines = append $lines "- ports:" -}}
{{- range $rule.ports -}}
{{- $lines = append $lines (include "pd-inference.policyPort" . | indent 4) -}}
{{- end -}}
{{- if not (has "any" $rule.from) -}}
{{- $lines = append $lines "  from:" -}}
{{- range $peer := $rule.from -}}
{{- if hasPrefix "networkPolicy." $peer -}}
{{- with get $np (trimPrefix "networkPolicy." $peer) -}}
{{- $lines = append $lines (toYaml . | indent 4) -}}
{{- end -}}
{{- else -}}
{{- $lines = append $lines (include "pd-inference.podPeer" (dict "ctx" $ctx "component" $peer) | indent 4) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- join "\n" $lines -}}
{{- end -}}

{{/*
A component's NetworkPolicy egress rules to the release's other pods: to each component that
renders (its own included: flexible engines pull KV from each other), the ports of it whose `from`
names this one. Call with (dict "ctx" $ "component" "prefill").
*/}}
{{- define "pd-inference.egressRules" -}}
{{- $ctx := .ctx -}}
{{- $self := .component -}}
{{- $lines := list -}}
{{- range $peer := append (include "pd-inference.engineRoles" $ctx | fromJsonArray) "router" -}}
{{- $ports := list -}}
{{- range $p := include "pd-inference.ports" (dict "ctx" $ctx "component" $peer) | fromJsonArray -}}
{{- if has $self $p.from -}}
{{- $ports = append $ports (include "pd-inference.policyPort" $p | indent 4) -}}
{{- end -}}
{{- end -}}
{{- if $ports -}}
{{- $lines = append $lines "- to:" -}}
{{- $lines = append $lines (include "pd-inference.podPeer" (dict "ctx" $ctx "component" $peer) | indent 4) -}}
{{- $lines = append $lines "  ports:" -}}
{{- $lines = concat $lines $ports -}}
{{- end -}}
{{- end -}}
{{- join "\n" $lines -}}
{{- end -}}
