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

{{/* The id by which the checkpoint lease knows this job (TRAINER_JOB_ID). A new install is a
new job, so that it may take a location whose earlier job was superseded there, and an
upgrade is the same job: `installId`, else the running job's ddp-trainer/install-id
annotation (lookup, asked only where the cluster serves the job's kind: never under `helm
template`), else one drawn now, set once for the whole render. */}}
{{- define "ddp.jobId" -}}
{{- if not .Values.installId -}}
{{- $api := ternary "kubeflow.org/v1" "trainer.kubeflow.org/v1alpha1" (eq .Values.jobKind "PyTorchJob") -}}
{{- $running := dict -}}
{{- if .Capabilities.APIVersions.Has (printf "%s/%s" $api .Values.jobKind) -}}
{{- $running = lookup $api .Values.jobKind .Release.Namespace (include "ddp.fullname" .) -}}
{{- end -}}
{{- $kept := dig "metadata" "annotations" "ddp-trainer/install-id" "" $running -}}
{{- $_ := set .Values "installId" (default (printf "i%s" (randAlphaNum 7 | lower)) $kept) -}}
{{- end -}}
{{- printf "%s/%s/%s" .Release.Namespace (include "ddp.fullname" .) .Values.installId -}}
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

{{/* Labels of the trainer pods, and exactly those of this install: what its NetworkPolicy
selects and admits (another install's differ in app.kubernetes.io/instance). */}}
{{- define "ddp.podLabels" -}}
{{ include "ddp.selectorLabels" . }}
app.kubernetes.io/component: trainer
{{- end -}}

{{/* The trainer image: repository@digest when image.digest is set (the bytes, whatever the
tag now names), else repository:tag. */}}
{{- define "ddp.image" -}}
{{- if and .Values.image.digest (not (regexMatch "^sha256:[a-f0-9]{64}$" .Values.image.digest)) -}}
{{- fail (printf "image.digest=%s: not an image digest; give sha256: and its 64 hex digits, as `docker buildx imagetools inspect IMAGE` or `docker inspect --format '{{index .RepoDigests 0}}' IMAGE` prints it" .Values.image.digest) -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
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

{{/* Values under a name of the previous release, still honoured for this one: old name ->
(new name, what NOTES.txt says). Each is read through the helpers below, never directly. */}}
{{- define "ddp.deprecations" -}}
{{- $lines := list -}}
{{- if hasKey .Values "checkpoints" -}}
{{- $lines = append $lines "checkpoints.* is now checkpoint.* (the trainer's name for it): rename it; the old name works until the next release" -}}
{{- end -}}
{{- if hasKey .Values "port" -}}
{{- $lines = append $lines "port is now rendezvous.port: rename it; the old name works until the next release" -}}
{{- end -}}
{{- if hasKey .Values.snapshots "everySteps" -}}
{{- $lines = append $lines "snapshots.everySteps is now trainer.config.checkpoint.snapshot_every_steps (the trainer's own key): move it there; the old name works until the next release" -}}
{{- end -}}
{{- toJson $lines -}}
{{- end -}}

{{/* The chart's `checkpoint` values, with the deprecated `checkpoints` over them where given. */}}
{{- define "ddp.checkpointValues" -}}
{{- $values := deepCopy .Values.checkpoint -}}
{{- with .Values.checkpoints }}{{ $values = mergeOverwrite $values (deepCopy .) }}{{ end -}}
{{- toJson $values -}}
{{- end -}}

{{/* The rendezvous port: rendezvous.port, or the deprecated top-level `port` where given. */}}
{{- define "ddp.rendezvousPort" -}}
{{- if hasKey .Values "port" }}{{ .Values.port }}{{ else }}{{ .Values.rendezvous.port }}{{ end -}}
{{- end -}}

{{/* The snapshot interval: the trainer's checkpoint.snapshot_every_steps (auto when unset),
or the deprecated snapshots.everySteps where given. */}}
{{- define "ddp.snapshotEvery" -}}
{{- if hasKey .Values.snapshots "everySteps" -}}
{{- .Values.snapshots.everySteps -}}
{{- else -}}
{{- dig "checkpoint" "snapshot_every_steps" "auto" .Values.trainer.config -}}
{{- end -}}
{{- end -}}

{{/* checkpoint.uri for the trainer: S3 when a bucket is set, else the mounted volume. */}}
{{- define "ddp.checkpointUri" -}}
{{- $checkpoint := include "ddp.checkpointValues" . | fromJson -}}
{{- if $checkpoint.s3.bucket -}}
{{- printf "s3://%s/%s" $checkpoint.s3.bucket (default .Release.Name $checkpoint.s3.prefix | trimPrefix "/") -}}
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
{{- if ne (include "ddp.snapshotEvery" .) "0" -}}
{{- add (include "ddp.mebibytes" .Values.shmSize) (mul 3 (include "ddp.mebibytes" .Values.snapshots.stateSize)) }}Mi
{{- else -}}
{{- .Values.shmSize -}}
{{- end -}}
{{- end -}}

{{/* The trainer config as rendered into the ConfigMap. The keys the chart manages have
their home in the chart's values (or in the pod's volumes): the same key in `trainer.config`
with another value is refused in one line that names both, never dropped in silence. */}}
{{- define "ddp.trainerConfig" -}}
{{- $managed := dict
  "checkpoint" (dict "uri" (include "ddp.checkpointUri" .) "cache_dir" "/tmp/checkpoint-cache"
    "snapshot_dir" "/dev/shm/ddp-trainer-snapshots")
  "metrics" (dict "port" (int .Values.metrics.port) "address" "0.0.0.0" "multiproc_dir" "/tmp/metrics")
-}}
{{- $homes := dict
  "checkpoint" (dict "uri" "checkpoint.s3.bucket and checkpoint.s3.prefix, or checkpoint.existingClaim")
  "metrics" (dict "port" "metrics.port")
-}}
{{- range $section, $keys := $managed -}}
{{- $given := get $.Values.trainer.config $section | default dict -}}
{{- range $key, $value := $keys -}}
{{- if and (kindIs "map" $given) (hasKey $given $key) (ne (toString (get $given $key)) (toString $value)) -}}
{{- $home := get (get $homes $section) $key -}}
{{- $name := printf "trainer.config.%s.%s=%v" $section $key (get $given $key) -}}
{{- if $home -}}
{{- fail (printf "%s: the chart sets this key from %s (now %v); set it there, or leave the trainer key out" $name $home $value) -}}
{{- else -}}
{{- fail (printf "%s: the chart sets this key to %v (the pod's own path for it); leave it out" $name $value) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if hasKey .Values.snapshots "everySteps" -}}{{/* deprecated: it wins over the tree's default */}}
{{- $_ := set $managed.checkpoint "snapshot_every_steps" .Values.snapshots.everySteps -}}
{{- end -}}
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

{{/* The CUDA allocator's and the NCCL flight recorder's variables for GPU pods (values.yaml
`cuda`): the recorder dumps a rank's last collectives when one times out
(torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp reads these; docs/facts.md). */}}
{{- define "ddp.cudaEnv" -}}
{{- with .Values.cuda.allocConf }}
- name: PYTORCH_CUDA_ALLOC_CONF
  value: {{ . | quote }}
{{- end }}
{{- with int .Values.cuda.flightRecorderEntries }}
- name: TORCH_NCCL_TRACE_BUFFER_SIZE
  value: {{ . | quote }}
- name: TORCH_NCCL_DUMP_ON_TIMEOUT
  value: "1"
- name: TORCH_FR_DUMP_TEMP_FILE
  value: /tmp/nccl-trace/rank_
{{- end }}
{{- end -}}

{{/*
What a TrainJob cannot take, refused in one line each (Trainer v2.3.0 and JobSet v0.12.0;
docs/facts.md): names too long for JobSet's pod names, elastic bounds, a JobSet TTL, pod
policies and gang settings v2 has no field for, torchrun's reserved PET_* names.
*/}}
{{- define "ddp.trainJobChecks" -}}
{{- $t := include "ddp.topology" . | fromJson -}}
{{- $name := include "ddp.fullname" . -}}
{{- /* jobset pkg/webhooks/jobset_webhook.go:243-255: "<name>-node-0-<last index>-abcde" is a DNS-1035 label */ -}}
{{- $longest := printf "%s-node-0-%d-abcde" $name (sub (int $t.nodes) 1) -}}
{{- if gt (len $longest) 63 -}}
{{- fail (printf "TrainJob name %q (%d characters): JobSet's pod names (%s) would pass 63 characters; choose a release name or fullnameOverride of at most %d characters" $name (len $name) $longest (sub (len $name) (sub (len $longest) 63))) -}}
{{- end -}}
{{- $bounds := include "ddp.elasticBounds" . | fromJson -}}
{{- if or (ne (int $bounds.min) (int $t.nodes)) (ne (int $bounds.max) (int $t.nodes)) -}}
{{- fail (printf "elastic.minNodes=%d, elastic.maxNodes=%d: a TrainJob trains on a fixed %d pods (Trainer v2 has no elastic API, kubeflow/trainer#2903); leave both 0, or use jobKind=PyTorchJob" (int .Values.elastic.minNodes) (int .Values.elastic.maxNodes) (int $t.nodes)) -}}
{{- end -}}
{{- if not (kindIs "invalid" .Values.runPolicy.ttlSecondsAfterFinished) -}}
{{- fail "runPolicy.ttlSecondsAfterFinished: not for a TrainJob: Trainer v2.3.0 re-creates a failed JobSet that its TTL removed, without bound (kubeflow/trainer#3779); leave it null" -}}
{{- end -}}
{{- if ne .Values.runPolicy.cleanPodPolicy "Running" -}}
{{- fail (printf "runPolicy.cleanPodPolicy=%s: a TrainJob has no such policy: JobSet deletes the pods still running when the job ends and keeps finished ones (as Running does); leave it Running" .Values.runPolicy.cleanPodPolicy) -}}
{{- end -}}
{{- if eq .Values.restartPolicy "Always" -}}
{{- fail "restartPolicy=Always: a TrainJob's pods belong to a Job, which takes ExitCode (Never with a podFailurePolicy), OnFailure or Never" -}}
{{- end -}}
{{- if or .Values.gang.queue .Values.gang.priorityClass -}}
{{- fail "gang.queue, gang.priorityClass: a TrainJob's gang (podGroupPolicy.coscheduling) has neither; queue through kueue.queueName and set priorityClassName instead" -}}
{{- end -}}
{{- range .Values.trainer.extraEnv -}}
{{- if has .name (list "PET_NNODES" "PET_NPROC_PER_NODE" "PET_NODE_RANK" "PET_MASTER_ADDR" "PET_MASTER_PORT") -}}
{{- fail (printf "trainer.extraEnv %s: Trainer v2 sets it (pkg/constants/constants.go:191-203, refused by its webhook); remove it" .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The user's tolerations; on GPU pods the nvidia.com/gpu taint's (GPU node pools carry it:
EKS, GKE and AKS taint their GPU nodes so); and nodeLoss's for a node that is unreachable or
not ready: the pod leaves a lost node after nodeLoss.tolerationSeconds, not the 300 s the
DefaultTolerationSeconds admission plugin gives. Each unless the user tolerates that key. */}}
{{- define "ddp.tolerations" -}}
{{- $tolerations := list }}
{{- $keys := list }}
{{- range .Values.tolerations }}
{{- $tolerations = append $tolerations . }}
{{- $keys = append $keys (.key | default "") }}
{{- end }}
{{- $t := include "ddp.topology" . | fromJson }}
{{- if and (gt (int $t.gpusPerPod) 0) (not (has "nvidia.com/gpu" $keys)) }}
{{- $tolerations = append $tolerations (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
{{- end }}
{{- $seconds := int .Values.nodeLoss.tolerationSeconds }}
{{- if gt $seconds 0 }}
{{- range list "node.kubernetes.io/unreachable" "node.kubernetes.io/not-ready" }}
{{- if not (has . $keys) }}
{{- $tolerations = append $tolerations (dict "key" . "operator" "Exists" "effect" "NoExecute" "tolerationSeconds" $seconds) }}
{{- end }}
{{- end }}
{{- end }}
{{- toYaml $tolerations }}
{{- end -}}
