{{/*
The KV-compatibility revision of this release's engines: a short hash of everything that makes
one engine's KV usable by another, the same for both roles. Every engine serves the model under
a second name that carries it (`<servedName>@kv-<revision>`, engine/_args.tpl) and its pods are
labelled with it; the router reads it from each engine's /v1/models and pairs a prefiller only
with a decoder of the same revision (router/src/pd_router/revision.py, whose SEPARATOR is the
"@kv-" here; tests/test_kv_revision.py checks the two agree).

What it covers, and why (vLLM 0.31.0 / 0.33.0): the weights and what decides the KV's numbers
(model.name, model.revision, the engine image, --dtype, --quantization, --hf-overrides,
--load-format), the tokens the KV is for (--tokenizer, --tokenizer-revision), and the KV's
layout and format (--kv-cache-dtype, --calculate-kv-scales, --block-size, --attention-backend,
the connector, its NIXL backend and LMCache's chunk size), from the extraArgs of every role
that renders (pd-inference.engineRoles: prefill and decode, or decode alone), and the flexible
layout (below). NixlConnector's own handshake hash covers the model string, dtype,
head shapes, attention backend and cache dtype but not the revision or the weights
(kv_connector/v1/nixl metadata compute_nixl_compatibility_hash); block size and TP are
checked at its handshake. Left out on purpose: each role's tensor-parallel size (NixlConnector
pairs different TP sizes, and a decode-only change must not restart the prefillers), and
everything only the router reads (a router or alert change restarts no engine).
*/}}
{{- define "pd-inference.kvRevision" -}}
{{- $v := .Values -}}
{{- $kvFlags := list "--dtype" "--quantization" "--hf-overrides" "--load-format" "--tokenizer" "--tokenizer-revision" "--kv-cache-dtype" "--calculate-kv-scales" "--block-size" "--attention-backend" -}}
{{- $flags := dict -}}
{{- range $role := include "pd-inference.engineRoles" . | fromJsonArray -}}
{{- $args := (get $v $role).extraArgs | default list -}}
{{- range $i, $a := $args -}}
{{- $a = toString $a -}}
{{- $name := regexReplaceAll "=.*$" $a "" -}}
{{- if has $name $kvFlags -}}
{{- $val := "" -}}
{{- if contains "=" $a -}}
{{- $val = trimPrefix (printf "%s=" $name) $a -}}
{{- else if lt (add1 $i) (len $args) -}}
{{- $val = toString (index $args (add1 $i)) -}}
{{- end -}}
{{- $_ := set $flags (printf "%s %s" $role $name) $val -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $in := dict
  "model" $v.model.name
  "revision" ($v.model.revision | default "")
  "image" (include "pd-inference.engine.image" (dict "ctx" .))
  "connector" $v.kvTransfer.connector
  "backend" (include "pd-inference.nixlBackend" .)
  "flags" $flags
-}}
{{- /* The connector's own inputs (templates/_connectors.tpl kvRevision: LMCache's chunk size). */ -}}
{{- $connector := include "pd-inference.connector" . | fromJson -}}
{{- range $key, $value := $connector.kvRevision -}}
{{- $_ := set $in $key (int (get (get $v.kvTransfer $connector.name) $value)) -}}
{{- end -}}
{{- /* Only in flexible, so a split release keeps its revision. The layout sets every engine's
kv_role (kv_both), which vLLM's scheduler acts on (is_kv_producer, is_kv_consumer in
v1/core/sched/scheduler.py): a switch is a new revision, so while the decode StatefulSet rolls
the router pairs no engine from before it with one from after it. */ -}}
{{- if include "pd-inference.flexible" . -}}
{{- $_ := set $in "layout" $v.engine.layout -}}
{{- end -}}
{{- toJson $in | sha256sum | trunc 10 -}}
{{- end -}}

{{/* The name a revision's engines also serve the model under (pd_router.revision.alias). */}}
{{- define "pd-inference.kvRevisionName" -}}
{{- printf "%s@kv-%s" .Values.model.servedName (include "pd-inference.kvRevision" .) -}}
{{- end -}}
