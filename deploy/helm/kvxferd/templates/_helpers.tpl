{{/* Names and labels shared by every object. */}}
{{- define "kvxferd.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvxferd.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvxferd.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
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

{{/* The pods of this release (both roles): who may use the peer ports and the UCX range. */}}
{{- define "kvxferd.peerFrom" -}}
{{- if .Values.networkPolicy.peerFrom -}}
{{- toYaml .Values.networkPolicy.peerFrom -}}
{{- else -}}
- podSelector:
    matchLabels:
      {{- include "kvxferd.selector" . | nindent 6 }}
{{- end -}}
{{- end -}}
