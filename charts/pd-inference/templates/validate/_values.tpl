{{/* Values that moved to another key. Included by pd-inference.validate (templates/_validate.tpl), in its order. */}}

{{- define "pd-inference.validate.moved" -}}
{{- $v := .Values -}}
{{- /* Values that moved (files/moved-values.yaml): the schema lets the old key through so that this names the new one. */ -}}
{{- range $old, $move := .Files.Get "files/moved-values.yaml" | fromYaml -}}
{{- if hasKey $v $old -}}
{{- fail (printf "%s: moved to %s in chart %s; put these values under %s (chart README, \"Upgrading\")" $old $move.to $move.since $move.to) -}}
{{- end -}}
{{- end -}}
{{- end -}}
