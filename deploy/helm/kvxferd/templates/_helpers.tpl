{{/* Names and labels shared by every object. */}}

{{/* The chart's name, or nameOverride. */}}
{{- define "kvxferd.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<name>, or the release alone when it already contains the name (or fullnameOverride). */}}
{{- define "kvxferd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "kvxferd.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvxferd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvxferd.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvxferd.selector" -}}
app.kubernetes.io/name: {{ include "kvxferd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvxferd.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "kvxferd.tlsSecret" -}}
{{- .Values.tls.secretName | default (printf "%s-peer-tls" (include "kvxferd.fullname" .)) -}}
{{- end -}}

{{- define "kvxferd.serviceAccountName" -}}
{{- .Values.serviceAccount.name | default (include "kvxferd.fullname" .) -}}
{{- end -}}

{{/* This release's peer identity: its namespace and ServiceAccount (tls.spiffeId overrides it). */}}
{{- define "kvxferd.spiffeId" -}}
{{- .Values.tls.spiffeId | default (printf "spiffe://%s/ns/%s/sa/%s" .Values.tls.trustDomain .Release.Namespace (include "kvxferd.serviceAccountName" .)) -}}
{{- end -}}

{{/* The pods of this release (every role): who may use the peer ports and the UCX range. */}}
{{- define "kvxferd.peerFrom" -}}
{{- if .Values.networkPolicy.peerFrom -}}
{{- toYaml .Values.networkPolicy.peerFrom -}}
{{- else -}}
- podSelector:
    matchLabels:
      {{- include "kvxferd.selector" . | nindent 6 }}
{{- end -}}
{{- end -}}

{{/* The labels of one role's objects; call with (dict "root" $ "role" $name). */}}
{{- define "kvxferd.roleLabels" -}}
{{ include "kvxferd.labels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "kvxferd.roleSelector" -}}
{{ include "kvxferd.selector" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{/* GPUs per pod of a role, as an int (YAML numbers reach templates as float64). */}}
{{- define "kvxferd.gpus" -}}
{{- int .tensorParallelSize -}}
{{- end -}}

{{/* For `helm test`: a Python list of (headless Service, [metrics ports]) per enabled role. */}}
{{- define "kvxferd.testTargets" -}}
{{- $targets := list -}}
{{- range $name, $role := .Values.roles -}}
{{- if $role.enabled -}}
{{- $ports := list -}}
{{- range $gpu := until (int $role.tensorParallelSize) -}}
{{- $ports = append $ports (add $.Values.ports.metrics $gpu) -}}
{{- end -}}
{{- $targets = append $targets (list (printf "%s-%s-peers" (include "kvxferd.fullname" $) $name) $ports) -}}
{{- end -}}
{{- end -}}
{{- toJson $targets -}}
{{- end -}}
