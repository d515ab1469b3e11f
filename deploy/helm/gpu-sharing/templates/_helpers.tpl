{{/* The name of every object: fixed (not per release), so deploy/ and the chart agree. */}}
{{- define "gpu-sharing.fullname" -}}
{{- default .Chart.Name .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The selector labels: as deploy/ has always had them (a DaemonSet's selector is immutable). */}}
{{- define "gpu-sharing.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-sharing.fullname" . }}
{{- end -}}

{{- define "gpu-sharing.labels" -}}
{{ include "gpu-sharing.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "gpu-sharing.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* deviceListStrategy as a comma list, whether given as a string or a YAML list. */}}
{{- define "gpu-sharing.deviceListStrategy" -}}
{{- if kindIs "slice" .Values.deviceListStrategy -}}
{{ join "," .Values.deviceListStrategy }}
{{- else -}}
{{ .Values.deviceListStrategy }}
{{- end -}}
{{- end -}}

{{/* The node's directory of the MPS keeper's socket: the agent's pods and the keeper's mount it. */}}
{{- define "gpu-sharing.keeperDir" -}}
{{ printf "%s/mps-keeper" (trimSuffix "/" .Values.stateDir) }}
{{- end -}}

{{/* The metrics Service's labels that the ServiceMonitor selects it by (no other Service has both). */}}
{{- define "gpu-sharing.metricsLabels" -}}
{{ include "gpu-sharing.selectorLabels" . }}
app.kubernetes.io/component: metrics
{{- end -}}

{{/* The `job` label of the agents' series: the Prometheus Operator names it after the Service the
ServiceMonitor found (its spec.jobLabel, unset here). */}}
{{- define "gpu-sharing.metricsJob" -}}
{{ include "gpu-sharing.fullname" . }}-metrics
{{- end -}}
