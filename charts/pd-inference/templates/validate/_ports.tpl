{{/*
Ports (templates/_ports.tpl): a per-rank port past 65535, or two ports of one pod on the same
number, in the pods that render (pd-inference.engineRoles and the router). Checked for every
connector (templates/_connectors.tpl), the release's first, the metrics proxy, the KV-cache
event ports and LMCache's MP server included, so that switching any of them later cannot collide.
*/}}
{{- define "pd-inference.validate.ports" -}}
{{- $v := .Values -}}
{{- $current := $v.kvTransfer.connector -}}
{{- $connectors := list $current -}}
{{- range $name, $_ := include "pd-inference.connectors" $ | fromJson -}}
{{- if ne $name $current -}}
{{- $connectors = append $connectors $name -}}
{{- end -}}
{{- end -}}
{{- range $connector := $connectors -}}
{{- $mode := ternary "" (printf " with kvTransfer.connector %s" $connector) (eq $connector $current) -}}
{{- range $component := append (include "pd-inference.engineRoles" $ | fromJsonArray) "router" -}}
{{- $ports := include "pd-inference.ports" (dict "ctx" $ "component" $component "connector" $connector "metricsProxy" true "kvEvents" true "lmcacheMp" true) | fromJsonArray -}}
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
