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

{{/* For `helm test`: a Python list of (headless Service, [metrics ports], replicas) per enabled role. */}}
{{- define "kvxferd.testTargets" -}}
{{- $targets := list -}}
{{- range $name, $role := .Values.roles -}}
{{- if $role.enabled -}}
{{- $ports := list -}}
{{- range $gpu := until (int $role.tensorParallelSize) -}}
{{- $ports = append $ports (add $.Values.ports.metrics $gpu) -}}
{{- end -}}
{{- $targets = append $targets (list (printf "%s-peers" (include "kvxferd.roleName" (dict "root" $ "role" $name))) $ports (int $role.replicas)) -}}
{{- end -}}
{{- end -}}
{{- toJson $targets -}}
{{- end -}}

{{/* A container's resources: the values' map (copied; null or empty allowed) plus the pod's GPUs,
     the DRA claim for every container, or resourceName on the engine with the device plugin.
     Call with (dict "root" $ "resources" <map> "gpus" <int> "engine" <bool>). */}}
{{- define "kvxferd.resources" -}}
{{- $resources := deepCopy (.resources | default dict) -}}
{{- if eq .root.Values.gpu.allocation "dra" -}}
{{- $_ := set $resources "claims" (list (dict "name" "gpus")) -}}
{{- else if .engine -}}
{{- $limits := deepCopy ((get $resources "limits") | default dict) -}}
{{- $_ := set $limits .root.Values.gpu.resourceName .gpus -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{/* <fullname>-<role>. With "-peers" (a Service: a DNS label) it must fit 63 characters; cutting it
     could give two roles one name, so a name too long is refused instead. */}}
{{- define "kvxferd.roleName" -}}
{{- $name := printf "%s-%s" (include "kvxferd.fullname" .root) .role -}}
{{- if gt (len $name) 57 -}}
{{- fail (printf "%s-peers is over 63 characters: use a shorter release or role name, or fullnameOverride" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* Values that would render pods that cannot work: refused with the reason, before anything is installed. */}}
{{- define "kvxferd.checkValues" -}}
{{- if and (not .Values.tls.enabled) (not .Values.insecure) -}}
{{- fail "tls.enabled=false needs insecure=true (development only): without TLS or --insecure every daemon refuses to start on the pod's address" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (not .Values.ports.ucx) -}}
{{- fail "ports.ucx=null with networkPolicy.enabled: UCX would listen on ports the policy drops, and reads between pods would fail; set ports.ucx or turn the policy off" -}}
{{- end -}}
{{- if and .Values.ports.ucx (gt (int .Values.ports.ucx.min) (int .Values.ports.ucx.max)) -}}
{{- fail "ports.ucx.min must not be above ports.ucx.max" -}}
{{- end -}}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) -}}
{{- fail "serviceAccount.create=false needs serviceAccount.name (an existing ServiceAccount)" -}}
{{- end -}}
{{- end -}}
