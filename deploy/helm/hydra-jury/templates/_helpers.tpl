{{/* Names: <release>-hydra-jury (or the release name when it holds the chart's). */}}
{{- define "hydra-jury.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hydra-jury.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of one component's objects: (dict "root" $ "component" "trunk"). */}}
{{- define "hydra-jury.componentName" -}}
{{- printf "%s-%s" (include "hydra-jury.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hydra-jury.shardName" -}}
{{- include "hydra-jury.componentName" (dict "root" .root "component" (printf "jury-%s" .shard.name)) }}
{{- end }}

{{/* Labels of one component's objects; the selector labels are their fixed part.
Context: (dict "root" $ "component" "jury" "shard" "a"), "shard" only for shards. */}}
{{- define "hydra-jury.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hydra-jury.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .shard }}
hydra-jury/shard: {{ . }}
{{- end }}
{{- end }}

{{- define "hydra-jury.labels" -}}
{{ include "hydra-jury.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "hydra-jury.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The bundled Redis is rendered only when no external one is named. */}}
{{- define "hydra-jury.bundledRedis" -}}
{{- if and (not .Values.redis.url) .Values.redis.enabled }}true{{ end }}
{{- end }}

{{/* What values.schema.json cannot say. */}}
{{- define "hydra-jury.validate" -}}
{{- if not .Values.jury.shards }}
{{- fail "jury.shards is empty: give at least one shard, each with a name and its heads (every llm head of the checkpoint in exactly one shard)" }}
{{- end }}
{{- $owner := dict }}
{{- $names := dict }}
{{- range $shard := .Values.jury.shards }}
{{- if hasKey $names $shard.name }}
{{- fail (printf "jury.shards: two shards are named %q; shard names must differ (they name the shards' Deployments and Services)" $shard.name) }}
{{- end }}
{{- $_ := set $names $shard.name true }}
{{- range $head := $shard.heads }}
{{- if hasKey $owner $head }}
{{- fail (printf "jury.shards: head %q is in shard %q and in shard %q; each head must be in exactly one shard" $head (get $owner $head) $shard.name) }}
{{- end }}
{{- $_ := set $owner $head $shard.name }}
{{- end }}
{{- end }}
{{- if and (not .Values.redis.url) (not .Values.redis.enabled) }}
{{- fail "redis: set redis.url to your Redis, or redis.enabled=true for the bundled trial instance" }}
{{- end }}
{{- if contains "@" .Values.redis.url }}
{{- fail "redis.url carries credentials: give it without them and put the password (URL-encoded) in a Secret named by redis.existingSecret" }}
{{- end }}
{{- if and .Values.redis.existingSecret (not .Values.redis.url) }}
{{- fail "redis.existingSecret holds the password of the Redis at redis.url: set redis.url too" }}
{{- end }}
{{- $internalTls := .Values.tls.internal }}
{{- if and (not $internalTls.secretName) (or $internalTls.clientSecretName $internalTls.serverName) }}
{{- fail "tls.internal.clientSecretName and tls.internal.serverName are for the services' mTLS: set tls.internal.secretName (their certificate) too" }}
{{- end }}
{{- if and $internalTls.secretName (eq .Values.discovery "kubernetes") (not $internalTls.serverName) }}
{{- fail "tls.internal.serverName is needed with discovery=kubernetes: the orchestrators connect to pod IPs, which no certificate names; give every service certificate one name and set it here" }}
{{- end }}
{{- if and .Values.tls.public.requireClientCertificate (not .Values.tls.public.secretName) }}
{{- fail "tls.public.requireClientCertificate needs tls.public.secretName (the public port's certificate, whose ca.crt verifies the clients)" }}
{{- end }}
{{- end }}

{{/* Device flag: the value, else cuda when the container's limits ask for a GPU. */}}
{{- define "hydra-jury.device" -}}
{{- if .device }}
{{- .device }}
{{- else if hasKey (default dict .resources.limits) "nvidia.com/gpu" }}
{{- "cuda" }}
{{- else }}
{{- "cpu" }}
{{- end }}
{{- end }}

{{/* Pod-level settings every hydra-jury pod shares; context: (dict "root" $ "spec" .). */}}
{{- define "hydra-jury.podSpec" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ add .root.Values.preStopSleepSeconds .root.Values.gracePeriodSeconds 10 }}
enableServiceLinks: false
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The fetching of the checkpoint, when an init container does it. */}}
{{- define "hydra-jury.initContainers" -}}
{{- if eq .Values.checkpoint.source "initContainer" }}
initContainers:
  - name: checkpoint
    image: {{ .Values.checkpoint.initContainer.image }}
    command:
      {{- toYaml .Values.checkpoint.initContainer.command | nindent 6 }}
    env:
      - name: CHECKPOINT_DIR
        value: /fill
    securityContext:
      {{- toYaml .Values.securityContext | nindent 6 }}
    resources:
      {{- toYaml .Values.checkpoint.initContainer.resources | nindent 6 }}
    volumeMounts:
      - name: checkpoint
        mountPath: /fill
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end }}

{{- define "hydra-jury.volumes" -}}
volumes:
  - name: tmp
    emptyDir:
      sizeLimit: {{ .Values.tmpSizeLimit }}
  - name: checkpoint
    {{- if eq .Values.checkpoint.source "pvc" }}
    persistentVolumeClaim:
      claimName: {{ .Values.checkpoint.pvc.claimName }}
      readOnly: true
    {{- else if eq .Values.checkpoint.source "hostPath" }}
    hostPath:
      path: {{ .Values.checkpoint.hostPath.path }}
      type: Directory
    {{- else }}
    emptyDir:
      {{- with .Values.checkpoint.initContainer.sizeLimit }}
      sizeLimit: {{ . }}
      {{- else }} {}
      {{- end }}
    {{- end }}
{{- end }}

{{- define "hydra-jury.volumeMounts" -}}
volumeMounts:
  - name: tmp
    mountPath: /tmp
  - name: checkpoint
    mountPath: {{ .Values.checkpoint.mountPath }}
    readOnly: true
    {{- if and (eq .Values.checkpoint.source "pvc") .Values.checkpoint.pvc.subPath }}
    subPath: {{ .Values.checkpoint.pvc.subPath }}
    {{- end }}
{{- end }}

{{/* Probes of a hydra-jury server: grpc.health.v1 on its port, or when its port is TLS
("tls" true) on the plaintext health port, since the kubelet's gRPC probes cannot do
TLS. Context: (dict "root" $ "port" 50051 "service" "hydrajury.v1.Trunk" "tls" false).
Readiness asks for the component's own service (NOT_SERVING from SIGTERM on), liveness
for the server as a whole. */}}
{{- define "hydra-jury.probes" -}}
{{- $probes := .root.Values.probes }}
{{- $port := .port }}
{{- if .tls }}
{{- $port = .root.Values.tls.healthPort }}
{{- end }}
startupProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml $probes.startup | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ $port }}
    service: {{ .service }}
  {{- toYaml $probes.readiness | nindent 2 }}
livenessProbe:
  grpc:
    port: {{ $port }}
  {{- toYaml $probes.liveness | nindent 2 }}
{{- end }}

{{/* A TLS server's flags over the Secret mounted at /tls/<mount>, with its ca.crt the
clients' CA when "mutual" (mTLS), and the plaintext health port for the probes.
Context: (dict "root" $ "mount" "internal" "mutual" true). */}}
{{- define "hydra-jury.tlsServerArgs" -}}
- --tls-cert=/tls/{{ .mount }}/tls.crt
- --tls-key=/tls/{{ .mount }}/tls.key
{{- if .mutual }}
- --tls-ca=/tls/{{ .mount }}/ca.crt
{{- end }}
- --health-listen=0.0.0.0:{{ .root.Values.tls.healthPort }}
{{- end }}

{{/* The container port of the plaintext health port. Context: $. */}}
{{- define "hydra-jury.healthPort" -}}
- name: health
  containerPort: {{ .Values.tls.healthPort }}
  protocol: TCP
{{- end }}

{{/* A pod's TLS Secrets, as volumes and as mounts at /tls/<mount>, read-only; context:
(dict "internal" SECRET "public" SECRET), an empty SECRET left out. Group-readable
only: the pods' fsGroup owns them. */}}
{{- define "hydra-jury.tlsVolumes" -}}
{{- range $mount, $secret := . }}
{{- if $secret }}
- name: tls-{{ $mount }}
  secret:
    secretName: {{ $secret }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end }}

{{- define "hydra-jury.tlsVolumeMounts" -}}
{{- range $mount, $secret := . }}
{{- if $secret }}
- name: tls-{{ $mount }}
  mountPath: /tls/{{ $mount }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* The sleep before SIGTERM, while the server still serves: its endpoint leaves the
Services (and the orchestrators' kubernetes discovery) first. Context: $. */}}
{{- define "hydra-jury.lifecycle" -}}
{{- if .Values.preStopSleepSeconds }}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .Values.preStopSleepSeconds }}"]
{{- end }}
{{- end }}

{{/* A HorizontalPodAutoscaler for a Deployment; context: (dict "root" $ "name" ...
"component" ... "shard" ... "autoscaling" ...). */}}
{{- define "hydra-jury.hpa" -}}
{{- if .autoscaling.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ .name }}
  labels:
    {{- include "hydra-jury.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ .name }}
  minReplicas: {{ .autoscaling.minReplicas }}
  maxReplicas: {{ .autoscaling.maxReplicas }}
  metrics:
    {{- if .autoscaling.metrics }}
    {{- toYaml .autoscaling.metrics | nindent 4 }}
    {{- else }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ .autoscaling.targetCPUUtilizationPercentage }}
    {{- end }}
{{- end }}
{{- end }}

{{/* A PodDisruptionBudget; same context as hydra-jury.hpa, with "pdb". */}}
{{- define "hydra-jury.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels:
    {{- include "hydra-jury.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "hydra-jury.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end }}

{{/* A pod template's annotations: podAnnotations, and Prometheus' scrape annotations
when metrics.scrapeAnnotations is set (every server serves /metrics). Context: $. */}}
{{- define "hydra-jury.podAnnotations" -}}
{{- $annotations := deepCopy .Values.podAnnotations }}
{{- if .Values.metrics.scrapeAnnotations }}
{{- $_ := set $annotations "prometheus.io/scrape" "true" }}
{{- $_ := set $annotations "prometheus.io/port" (toString .Values.metrics.port) }}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
{{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* A server's metrics flags (args) and container port. Context: $. */}}
{{- define "hydra-jury.metricsArgs" -}}
- --metrics-port={{ .Values.metrics.port }}
- --metrics-address=0.0.0.0
{{- end }}

{{- define "hydra-jury.metricsPort" -}}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end }}

{{/* Ingress to a component from the orchestrators only, on one port; and to its
metrics port (when it has one) from networkPolicy.metricsFrom (empty: any source). */}}
{{- define "hydra-jury.fromOrchestrators" -}}
{{- if .root.Values.networkPolicy.enabled }}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ .name }}
  labels:
    {{- include "hydra-jury.labels" . | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "hydra-jury.selectorLabels" . | nindent 6 }}
  policyTypes: [Ingress]
  ingress:
    - from:
        - podSelector:
            matchLabels:
              {{- include "hydra-jury.selectorLabels" (dict "root" .root "component" "orchestrator") | nindent 14 }}
      ports:
        - protocol: TCP
          port: {{ .port }}
    {{- if .metrics }}
    - ports:
        - protocol: TCP
          port: {{ .root.Values.metrics.port }}
      {{- with .root.Values.networkPolicy.metricsFrom }}
      from:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- end }}
{{- end }}
{{- end }}

{{/* Where the orchestrator finds Redis: $HYDRA_JURY_REDIS_URL, with the password from
the Secret put in by Kubernetes' $(VAR) expansion, so the URL with the password never
stands in the pod spec. */}}
{{- define "hydra-jury.redisEnv" -}}
{{- if include "hydra-jury.bundledRedis" . }}
- name: HYDRA_JURY_REDIS_URL
  value: redis://{{ include "hydra-jury.componentName" (dict "root" $ "component" "redis") }}:6379/0
{{- else if .Values.redis.existingSecret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretPasswordKey }}
- name: HYDRA_JURY_REDIS_URL
  value: {{ regexReplaceAll "^(rediss?)://" .Values.redis.url "${1}://:$(REDIS_PASSWORD)@" | quote }}
{{- else }}
- name: HYDRA_JURY_REDIS_URL
  value: {{ .Values.redis.url | quote }}
{{- end }}
{{- end }}

{{/* OpenTelemetry's standard variables, which every server reads itself: where its spans
go, how they are sampled, and the resource naming the process (the pod's name by the
downward API, put into OTEL_RESOURCE_ATTRIBUTES by Kubernetes' $(VAR) expansion, so it
is declared first). Nothing without tracing.otlpEndpoint. Context: (dict "root" $
"service" "hydra-jury-jury" "shard" "a"), "shard" only for shards. */}}
{{- define "hydra-jury.tracingEnv" -}}
{{- $tracing := .root.Values.tracing }}
{{- if $tracing.otlpEndpoint }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $tracing.otlpEndpoint | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $tracing.sampler | quote }}
{{- if ne (toString $tracing.samplerArg) "" }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ toString $tracing.samplerArg | quote }}
{{- end }}
- name: OTEL_SERVICE_NAME
  value: {{ .service | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,k8s.pod.name=$(POD_NAME)%s" .root.Release.Namespace (ternary (printf ",hydra.shard=%s" .shard) "" (hasKey . "shard")) | quote }}
{{- end }}
{{- end }}

{{/* The labels of every monitoring object (the dashboard, the alerts). Context: $. */}}
{{- define "hydra-jury.monitoringLabels" -}}
{{ include "hydra-jury.labels" (dict "root" . "component" "monitoring") }}
{{- end }}

{{/* The PromQL label matchers of the release's series: alerts.selector, else the
release's namespace and the jobs its ServiceMonitors scrape (a ServiceMonitor's job is
its Service's name, <fullname>-<server>-metrics). Context: $. */}}
{{- define "hydra-jury.alertSelector" -}}
{{- with .Values.alerts.selector }}
{{- . }}
{{- else }}
{{- printf "namespace=%q,job=~%q" .Release.Namespace (printf "%s-.+-metrics" (include "hydra-jury.fullname" .)) }}
{{- end }}
{{- end }}

{{/* An alert's labels: alerts.alertLabels and its severity. Context: (dict "root" $
"alert" .Values.alerts.NAME). */}}
{{- define "hydra-jury.alertLabels" -}}
{{- toYaml (mergeOverwrite (deepCopy .root.Values.alerts.alertLabels) (dict "severity" .alert.severity)) }}
{{- end }}
