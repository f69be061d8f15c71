{{/*
One daemon container (rank "gpu" of a pod of "gpus"), in the pod's containers or, as a native sidecar (Kubernetes
>= 1.29), in its initContainers with restartPolicy Always: started before the engine, each one's
startupProbe passed first, and stopped after it (values.yaml: nativeSidecars).
*/}}
{{- define "kvxferd.daemonContainer" -}}
{{- $root := .root -}}
{{- $gpu := .gpu -}}
{{- $gpus := .gpus -}}
- name: kvxferd-{{ $gpu }}
  {{- if .native }}
  restartPolicy: Always  # a native sidecar: the engine starts after its startupProbe, and stops first
  {{- end }}
  image: {{ include "kvxferd.image" $root }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  args:
    - serve
    - --config=/etc/kvxferd/kvxferd.yaml
    - --daemon-id=$(POD_NAME)-gpu{{ $gpu }}
    - --engine-socket=/run/kvxferd/gpu{{ $gpu }}.sock
    - --peer-port={{ add $root.Values.ports.peer $gpu }}
    - --notify-port={{ add $root.Values.ports.notify $gpu }}
    - --metrics-port={{ add $root.Values.ports.metrics $gpu }}
  env:
    - name: POD_NAME
      valueFrom:
        fieldRef: {fieldPath: metadata.name}
    - name: POD_IP
      valueFrom:
        fieldRef: {fieldPath: status.podIP}
    # Peers dial the pod IP: never a loopback address inside a pod.
    - name: KVXFERD_ADVERTISE_HOST
      value: $(POD_IP)
    {{- with $root.Values.tracing.otlpEndpoint }}
    # OpenTelemetry traces of P/D requests (docs/tracing.md): the OTLP/gRPC collector
    - name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
      value: {{ . | quote }}
    - name: OTEL_SERVICE_NAME
      value: {{ $root.Values.tracing.serviceName | quote }}
    - name: OTEL_RESOURCE_ATTRIBUTES
      value: k8s.pod.name=$(POD_NAME)
    {{- end }}
    {{- if eq $root.Values.gpu.allocation "devicePlugin" }}
    # The device plugin gave the GPUs to the engine container only (values.yaml: gpu).
    - name: NVIDIA_VISIBLE_DEVICES
      value: {{ $root.Values.gpu.daemonVisibleDevices | quote }}
    {{- end }}
  ports:
    - {name: peer-{{ $gpu }}, containerPort: {{ add $root.Values.ports.peer $gpu }}}
    - {name: metrics-{{ $gpu }}, containerPort: {{ add $root.Values.ports.metrics $gpu }}}
  # Probes ask grpc.health.v1 over the engine socket: the peer port speaks mutual TLS only.
  startupProbe:
    exec: {command: [kvxferd, health, --target, "unix:/run/kvxferd/gpu{{ $gpu }}.sock"]}
    periodSeconds: 2
    failureThreshold: 60
  livenessProbe:
    exec: {command: [kvxferd, health, --target, "unix:/run/kvxferd/gpu{{ $gpu }}.sock"]}
    periodSeconds: 10
    failureThreshold: 3
  readinessProbe:
    # NOT_SERVING while draining: peers stop being sent here.
    exec: {command: [kvxferd, health, --target, "unix:/run/kvxferd/gpu{{ $gpu }}.sock", --service, kvxfer.v1.PeerService]}
    periodSeconds: 5
  resources:
    {{- include "kvxferd.resources" (dict "root" $root "resources" $root.Values.resources "gpus" $gpus "engine" false) | nindent 4 }}
  securityContext:
    runAsUser: {{ int ($root.Values.daemonSecurityContext.runAsUser | default 10001) }}
    runAsGroup: {{ int ($root.Values.daemonSecurityContext.runAsGroup | default 10001) }}
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: [ALL]}
  volumeMounts:
    - {name: sockets, mountPath: /run/kvxferd}
    - {name: shm, mountPath: /dev/shm}
    - {name: tmp, mountPath: /tmp}
    - {name: config, mountPath: /etc/kvxferd, readOnly: true}
    {{- if $root.Values.tls.enabled }}
    - {name: tls, mountPath: /etc/kvxferd/tls, readOnly: true}
    {{- end }}
{{- end }}
