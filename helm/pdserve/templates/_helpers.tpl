{{/* Names, labels and the pieces every pdserve pod shares. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels of every resource; call with (dict "root" $ "component" NAME). */}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image of a pdserve container; call with (dict "root" $ "gpu" BOOL). */}}
{{- define "pdserve.image" -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag }}
{{- if .gpu }}{{ $tag = printf "%s%s" $tag .root.Values.gpu.tagSuffix }}{{ end }}
{{- printf "%s:%s" .root.Values.image.repository $tag }}
{{- end }}

{{- define "pdserve.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "pdserve.fullname" .)) .Values.apiKey.existingSecret }}
{{- end }}

{{- define "pdserve.apiKeySecretKey" -}}
{{- if .Values.apiKey.existingSecret }}{{ .Values.apiKey.existingSecretKey }}{{ else }}api-key{{ end }}
{{- end }}

{{- define "pdserve.externalRedis" -}}
{{- if and .Values.redis.url .Values.redis.existingSecret }}
{{- fail "set either redis.url or redis.existingSecret, not both" }}
{{- end }}
{{- if or .Values.redis.url .Values.redis.existingSecret }}true{{ end }}
{{- end }}

{{/* Env of containers that take the API key: it comes only from the Secret, never from a plain value. */}}
{{- define "pdserve.apiKeyEnv" -}}
{{- if .Values.apiKey.enabled -}}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.apiKeySecretName" . }}
      key: {{ include "pdserve.apiKeySecretKey" . }}
{{- end }}
{{- end }}

{{- define "pdserve.clusterTokenSecretName" -}}
{{- default (printf "%s-cluster-token" (include "pdserve.fullname" .)) .Values.clusterToken.existingSecret }}
{{- end }}

{{/* Env of the workers and the gateway: the cluster token, from its Secret only. */}}
{{- define "pdserve.clusterTokenEnv" -}}
- name: PDSERVE_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.clusterTokenSecretName" . }}
      key: {{ if .Values.clusterToken.existingSecret }}{{ .Values.clusterToken.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}

{{- define "pdserve.adminApiKeySecretName" -}}
{{- default (printf "%s-admin-api-key" (include "pdserve.fullname" .)) .Values.adminApiKey.existingSecret }}
{{- end }}

{{/* Env of the gateway only: the key its admin routes need, from its Secret only. */}}
{{- define "pdserve.adminApiKeyEnv" -}}
- name: PDSERVE_ADMIN_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.adminApiKeySecretName" . }}
      key: {{ if .Values.adminApiKey.existingSecret }}{{ .Values.adminApiKey.existingSecretKey }}{{ else }}admin-api-key{{ end }}
{{- end }}

{{- define "pdserve.redisAuthSecretName" -}}
{{ include "pdserve.fullname" . }}-redis-auth
{{- end }}

{{/* PDSERVE_REDIS_URL of the jobs service and the gateway (stored /v1/responses): an existing Secret, a plain redis.url, or the chart's Redis (its URL,
with the generated password, from the chart's Secret). Never in args: those show in `ps`. */}}
{{- define "pdserve.redisUrlEnv" -}}
- name: PDSERVE_REDIS_URL
{{- if .Values.redis.existingSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- else if .Values.redis.url }}
  value: {{ .Values.redis.url | quote }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.redisAuthSecretName" . }}
      key: url
{{- end }}
{{- end }}

{{/* Graceful stop: a stopping pod keeps serving for the preStop sleep (its Service endpoints go first), then
drains on SIGTERM for up to `drain` seconds. terminationGracePeriodSeconds covers both with 10 s to spare; call
with (dict "root" $ "drain" SECONDS). */}}
{{- define "pdserve.gracePeriod" -}}
{{- $stop := .root.Values.gracefulStop }}
{{- add $stop.preStopSleepSeconds .drain 10 }}
{{- end }}

{{- define "pdserve.preStop" -}}
lifecycle:
  preStop:
    exec: {command: [sleep, {{ .Values.gracefulStop.preStopSleepSeconds | quote }}]}
{{- end }}

{{/* Host names the gateway and decode resolve: one headless Service per worker role. */}}
{{- define "pdserve.prefillAddress" -}}
{{ include "pdserve.fullname" . }}-prefill:{{ .Values.prefill.port }}
{{- end }}
{{- define "pdserve.decodeAddress" -}}
{{ include "pdserve.fullname" . }}-decode:{{ .Values.decode.port }}
{{- end }}
{{- define "pdserve.embeddingAddress" -}}
{{ include "pdserve.fullname" . }}-embedding:{{ .Values.embedding.port }}
{{- end }}

{{/* /health probes on a named port; call with (dict "root" $ "port" NAME). */}}
{{- define "pdserve.probes" -}}
startupProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: {{ .root.Values.probes.startup.periodSeconds }}
  failureThreshold: {{ .root.Values.probes.startup.failureThreshold }}
readinessProbe:
  httpGet: {path: /health, port: {{ .port }}}
  periodSeconds: {{ .root.Values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .root.Values.probes.readiness.failureThreshold }}
livenessProbe:
  httpGet: {path: {{ .live | default "/health" }}, port: {{ .port }}}
  periodSeconds: {{ .root.Values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .root.Values.probes.liveness.failureThreshold }}
{{- end }}

{{/* The models volume and its mount; pods that need the model also run the prepare-model init container. */}}
{{- define "pdserve.modelVolume" -}}
- name: models
{{- if .Values.model.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "pdserve.modelMount" -}}
- name: models
  mountPath: /var/cache/pdserve
{{- end }}

{{/* The workers' LoRA flags, and the adapters' volume and mount when lora.existingClaim is set. */}}
{{- define "pdserve.loraArgs" -}}
{{- with .Values.lora }}
{{- if .enabled }}
- --enable-lora
- --max-loras-per-batch
- {{ .maxLorasPerBatch | quote }}
{{- if .maxRank }}
- --max-lora-rank
- {{ .maxRank | quote }}
{{- end }}
{{- if .adapters }}
- --lora-paths
{{- range $name, $path := .adapters }}
- {{ printf "%s=%s" $name $path | quote }}
{{- end }}
{{- end }}
{{- if .targetModules }}
- --lora-target-modules
{{- range .targetModules }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.loraVolume" -}}
{{- if and .Values.lora.enabled .Values.lora.existingClaim }}
- name: lora-adapters
  persistentVolumeClaim:
    claimName: {{ .Values.lora.existingClaim }}
    readOnly: true
{{- end }}
{{- end }}

{{- define "pdserve.loraMount" -}}
{{- if and .Values.lora.enabled .Values.lora.existingClaim }}
- name: lora-adapters
  mountPath: {{ .Values.lora.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The KV tiers (kvTiers.enabled): the workers' flags (and a host-memory tier on GPU workers), the storage volume and its mount. */}}
{{- define "pdserve.kvTiersArgs" -}}
{{- with .Values.kvTiers }}
{{- if .enabled }}
- --enable-hierarchical-cache
- --hicache-storage-backend
- file
- --hicache-storage-dir
- {{ .mountPath | quote }}
- --hicache-write-policy
- {{ .writePolicy | quote }}
- --hicache-storage-prefetch-policy
- {{ .prefetchPolicy | quote }}
- --hicache-storage-prefetch-timeout
- {{ .prefetchTimeoutSeconds | quote }}
{{- if .maxSize }}
- --hicache-storage-max-size
- {{ .maxSize | quote }}
{{- end }}
{{- if .minFreeSpace }}
- --hicache-storage-min-free-space
- {{ .minFreeSpace | quote }}
{{- end }}
{{- if .evictionRatio }}
- --hicache-storage-eviction-ratio
- {{ .evictionRatio | quote }}
{{- end }}
{{- if .groupAccess }}
- --hicache-storage-group-access
{{- end }}
{{- if or .hostRatio .hostSizeGB }}
{{- if not $.Values.gpu.enabled }}
{{- fail "kvTiers.hostRatio / kvTiers.hostSizeGB size the host-memory tier of GPU workers (gpu.enabled): a CPU worker's pool already lives in host memory" }}
{{- end }}
{{- if .hostSizeGB }}
- --hicache-size
- {{ .hostSizeGB | quote }}
{{- else }}
- --hicache-ratio
- {{ .hostRatio | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.kvTiersVolume" -}}
{{- with .Values.kvTiers }}
{{- if .enabled }}
- name: kv-storage
{{- if .existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .existingClaim }}
{{- else if .sizeLimit }}
  emptyDir:
    sizeLimit: {{ .sizeLimit | quote }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.kvTiersMount" -}}
{{- if .Values.kvTiers.enabled }}
- name: kv-storage
  mountPath: {{ .Values.kvTiers.mountPath }}
{{- end }}
{{- end }}

{{/* call with (dict "root" $ "gpu" BOOL "resources" DICT), and "model" PATH "name" NAME for a model other than model.path */}}
{{- define "pdserve.prepareModel" -}}
- name: {{ .name | default "prepare-model" }}
  image: {{ include "pdserve.image" (dict "root" .root "gpu" .gpu) }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  args: [prepare-model, --model-path, {{ .model | default .root.Values.model.path | quote }}]
  env:
    - name: PDSERVE_CACHE_DIR
      value: /var/cache/pdserve
  resources: {{- toYaml .resources | nindent 4 }}
  securityContext: {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts: {{- include "pdserve.modelMount" .root | nindent 4 }}
{{- end }}

{{- define "pdserve.podSpecCommon" -}}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
securityContext: {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{- /* The tracing flags of the gateway and every worker (tracing.enabled). */ -}}
{{- define "pdserve.traceArgs" -}}
{{- with .Values.tracing }}
{{- if .enabled }}
- --otlp-traces-endpoint
- {{ .endpoint | quote }}
- --otlp-traces-sample-ratio
- {{ .sampleRatio | quote }}
{{- if .trustClientContext }}
- --otlp-traces-trust-client-context
{{- end }}
{{- if .includeContent }}
- --otlp-traces-include-content
- --otlp-traces-content-max-size
- {{ .contentMaxSize | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* OpenTelemetry's variables for the exporter's protocol and the collector's CA (tracing.protocol, caSecret),
and the CA's volume and mount. */}}
{{- define "pdserve.traceEnv" -}}
{{- with .Values.tracing }}
{{- if .enabled }}
{{- if .protocol }}
- name: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
  value: {{ .protocol | quote }}
{{- end }}
{{- if .caSecret }}
- name: OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE
  value: /etc/pdserve/otlp-ca/ca.crt
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.traceVolume" -}}
{{- if and .Values.tracing.enabled .Values.tracing.caSecret }}
- name: otlp-ca
  secret:
    secretName: {{ .Values.tracing.caSecret }}
{{- end }}
{{- end }}

{{- define "pdserve.traceMount" -}}
{{- if and .Values.tracing.enabled .Values.tracing.caSecret }}
- name: otlp-ca
  mountPath: /etc/pdserve/otlp-ca
  readOnly: true
{{- end }}
{{- end }}
