{{/* Chart name, truncated to 63 characters. */}}
{{- define "ddp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name: release-chart, or the release name when it already contains the chart name.
Truncated to 52 so that suffixed objects (-config, -dashboard) and the operator's pod names
(<job>-worker-NNN) stay within 63 characters.
*/}}
{{- define "ddp.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ddp.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "ddp.labels" -}}
helm.sh/chart: {{ include "ddp.chart" . }}
{{ include "ddp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ddp-trainer
{{- end -}}

{{/* Labels that select this release's pods. */}}
{{- define "ddp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ddp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ddp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ddp.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
Pods and processes from the GPU count, as JSON: {"nodes", "procs", "gpusPerPod", "worldSize"}.
Fails with what to set when the count does not split into whole nodes.
*/}}
{{- define "ddp.topology" -}}
{{- $gpus := int .Values.gpus -}}
{{- $perNode := int .Values.gpusPerNode -}}
{{- if lt $gpus 0 -}}
{{- fail (printf "gpus=%d: must be 0 (CPU) or a positive GPU count" $gpus) -}}
{{- end -}}
{{- $nodes := 0 -}}
{{- $procs := 0 -}}
{{- $gpusPerPod := 0 -}}
{{- if eq $gpus 0 -}}
{{- $nodes = int .Values.cpuNodes -}}
{{- $procs = int .Values.cpuProcsPerNode -}}
{{- if or (lt $nodes 1) (lt $procs 1) -}}
{{- fail (printf "gpus=0 (CPU mode) needs cpuNodes >= 1 and cpuProcsPerNode >= 1, got %d and %d" $nodes $procs) -}}
{{- end -}}
{{- else if lt $perNode 1 -}}
{{- fail (printf "gpusPerNode=%d: must be at least 1" $perNode) -}}
{{- else if le $gpus $perNode -}}
{{- $nodes = 1 -}}
{{- $procs = $gpus -}}
{{- $gpusPerPod = $gpus -}}
{{- else if ne (mod $gpus $perNode) 0 -}}
{{- fail (printf "gpus=%d does not split into whole nodes of gpusPerNode=%d: set gpus to a multiple of %d (e.g. %d) or gpusPerNode to a divisor of %d" $gpus $perNode $perNode (mul (add (div $gpus $perNode) 1) $perNode) $gpus) -}}
{{- else -}}
{{- $nodes = div $gpus $perNode -}}
{{- $procs = $perNode -}}
{{- $gpusPerPod = $perNode -}}
{{- end -}}
{{- dict "nodes" $nodes "procs" $procs "gpusPerPod" $gpusPerPod "worldSize" (mul $nodes $procs) | toJson -}}
{{- end -}}

{{/* Elastic bounds, as JSON {"min", "max"}, checked against the computed pod count. */}}
{{- define "ddp.elasticBounds" -}}
{{- $t := include "ddp.topology" . | fromJson -}}
{{- $min := int (default $t.nodes .Values.elastic.minNodes) -}}
{{- $max := int (default $t.nodes .Values.elastic.maxNodes) -}}
{{- if or (gt $min $max) (gt $min (int $t.nodes)) (lt $max (int $t.nodes)) -}}
{{- fail (printf "elastic.minNodes=%d and elastic.maxNodes=%d must bracket the %d pods that gpus=%d gives" $min $max (int $t.nodes) (int .Values.gpus)) -}}
{{- end -}}
{{- dict "min" $min "max" $max | toJson -}}
{{- end -}}

{{/* checkpoint.uri for the trainer: S3 when a bucket is set, else the mounted volume. */}}
{{- define "ddp.checkpointUri" -}}
{{- if .Values.checkpoints.s3.bucket -}}
{{- printf "s3://%s/%s" .Values.checkpoints.s3.bucket (default .Release.Name .Values.checkpoints.s3.prefix | trimPrefix "/") -}}
{{- else -}}
/checkpoints/{{ .Release.Name }}
{{- end -}}
{{- end -}}

{{/* A size in Mi, Gi or Ti as a whole number of MiB (the schema admits no other form). */}}
{{- define "ddp.mebibytes" -}}
{{- $quantity := toString . -}}
{{- $number := regexFind "^[0-9]+" $quantity -}}
{{- $factor := get (dict "Mi" 1 "Gi" 1024 "Ti" 1048576) (trimPrefix $number $quantity) -}}
{{- if or (not $number) (not $factor) -}}
{{- fail (printf "size %q: use a whole number of Mi, Gi or Ti" $quantity) -}}
{{- end -}}
{{- mul (int $number) $factor -}}
{{- end -}}

{{/* /dev/shm's size limit: shmSize, plus two snapshots and the writer's host copy of the
training state when snapshots are on. */}}
{{- define "ddp.shmSizeLimit" -}}
{{- if ne (toString .Values.snapshots.everySteps) "0" -}}
{{- add (include "ddp.mebibytes" .Values.shmSize) (mul 3 (include "ddp.mebibytes" .Values.snapshots.stateSize)) }}Mi
{{- else -}}
{{- .Values.shmSize -}}
{{- end -}}
{{- end -}}

{{/* The trainer config as rendered into the ConfigMap. */}}
{{- define "ddp.trainerConfig" -}}
{{- $managed := dict
  "checkpoint" (dict "uri" (include "ddp.checkpointUri" .) "cache_dir" "/tmp/checkpoint-cache"
    "snapshot_every_steps" .Values.snapshots.everySteps "snapshot_dir" "/dev/shm/ddp-trainer-snapshots")
  "metrics" (dict "port" (int .Values.metrics.port) "address" "0.0.0.0" "multiproc_dir" "/tmp/metrics")
-}}
{{- mergeOverwrite (deepCopy .Values.trainer.config) $managed | toYaml -}}
{{- end -}}

{{/* NCCL's variables for GPU pods (values.yaml `nccl`), sorted by name; `nccl.env` wins. */}}
{{- define "ddp.ncclEnv" -}}
{{- $n := .Values.nccl -}}
{{- $vars := dict "NCCL_DEBUG" $n.debug -}}
{{- with $n.socketIfname }}{{ $_ := set $vars "NCCL_SOCKET_IFNAME" . }}{{ end }}
{{- if $n.rdma.enabled }}
{{- with $n.rdma.hca }}{{ $_ := set $vars "NCCL_IB_HCA" . }}{{ end }}
{{- with $n.rdma.gdrLevel }}{{ $_ := set $vars "NCCL_NET_GDR_LEVEL" . }}{{ end }}
{{- else }}
{{- $_ := set $vars "NCCL_IB_DISABLE" "1" }}
{{- end }}
{{- range $name, $value := $n.env }}{{ $_ := set $vars $name (toString $value) }}{{ end }}
{{- range $name, $value := $vars }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end -}}
