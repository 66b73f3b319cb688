{{/* Client authentication on the public API: the key file comes from a Secret (an
existing one, or one this chart makes from `apiKeys.keys`), mounted into the
orchestrators as a directory (so an updated Secret reaches the pods, which reload it)
and passed as --api-keys. */}}

{{/* The Secret holding the key file; empty: the API is open. Context: $. */}}
{{- define "hydra-jury.apiKeysSecret" -}}
{{- if .Values.apiKeys.existingSecret }}
{{- .Values.apiKeys.existingSecret }}
{{- else if .Values.apiKeys.keys }}
{{- include "hydra-jury.componentName" (dict "root" . "component" "api-keys") }}
{{- end }}
{{- end }}

{{/* What values.schema.json cannot say about `apiKeys`. Renders nothing. */}}
{{- define "hydra-jury.validateApiKeys" -}}
{{- $keys := .Values.apiKeys }}
{{- if and $keys.existingSecret $keys.keys }}
{{- fail "apiKeys: set existingSecret (a Secret you made) or keys (the chart makes one), not both" }}
{{- end }}
{{- if and (or $keys.maxConcurrentPerKey $keys.tokensPerMinutePerKey) (not (include "hydra-jury.apiKeysSecret" .)) }}
{{- fail "apiKeys.maxConcurrentPerKey and apiKeys.tokensPerMinutePerKey limit API keys: set apiKeys.existingSecret or apiKeys.keys too" }}
{{- end }}
{{- end }}

{{/* The orchestrator's flags. Context: $. */}}
{{- define "hydra-jury.apiKeysArgs" -}}
{{- if include "hydra-jury.apiKeysSecret" . }}
- {{ printf "--api-keys=/api-keys/%s" .Values.apiKeys.secretKey | quote }}
{{- with .Values.apiKeys.maxConcurrentPerKey }}
- --max-concurrent-per-key={{ . }}
{{- end }}
{{- with .Values.apiKeys.tokensPerMinutePerKey }}
- --tokens-per-minute-per-key={{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret as a volume, and its mount; group-readable only (the pods' fsGroup).
Context: $. */}}
{{- define "hydra-jury.apiKeysVolume" -}}
{{- with include "hydra-jury.apiKeysSecret" . }}
- name: api-keys
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "hydra-jury.apiKeysVolumeMount" -}}
{{- if include "hydra-jury.apiKeysSecret" . }}
- name: api-keys
  mountPath: /api-keys
  readOnly: true
{{- end }}
{{- end }}
