{{/* The pod template shared by a PyTorchJob's Master and Worker replicas and by the
TrainingRuntime's `node` job: one trainer container, named as each operator requires. */}}
{{- define "ddp.podTemplate" -}}
{{- include "ddp.podChecks" . -}}
{{- $t := include "ddp.topology" . | fromJson -}}
{{- $checkpoint := include "ddp.checkpointValues" . | fromJson -}}
{{- $s3 := $checkpoint.s3 -}}
{{- $trainJob := eq .Values.jobKind "TrainJob" -}}
metadata:
  labels:
    {{- include "ddp.podLabels" . | nindent 4 }}
  annotations:
    checksum/config: {{ include "ddp.trainerConfig" . | sha256sum }}
    {{- with .Values.kueue.topology.level }}
    # Kueue's TAS reads it from each PodSet's template: the replicas', or the runtime's node job's
    kueue.x-k8s.io/podset-{{ $.Values.kueue.topology.mode }}-topology: {{ . | quote }}
    {{- if and (not $trainJob) (eq $.Values.mode "fixed") (gt (int $t.nodes) 1) }}
    # the Master and the Workers fitted into one domain, not each into its own (Kueue's
    # groups are of exactly two PodSets, one of a single pod: tas_validation.go:214-262)
    kueue.x-k8s.io/podset-group-name: trainer
    {{- end }}
    {{- end }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "ddp.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  {{- if $trainJob }}
  # ExitCode's meaning comes from the Job's podFailurePolicy, which needs Never
  restartPolicy: {{ ternary "OnFailure" "Never" (eq .Values.restartPolicy "OnFailure") }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (include "ddp.tolerations" . | fromYamlArray) }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    {{- /* each operator's name: v1 finds `pytorch` (its DefaultContainerName), Trainer v2
    injects PET_* into `node` (pkg/constants/constants.go:69) */}}
    - name: {{ ternary "node" "pytorch" $trainJob }}
      image: {{ include "ddp.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      # exec form: SIGTERM reaches ddp-launch, which forwards it to torchrun and the workers;
      # ddp-launch checks the config first and waits for the rendezvous host (values.yaml)
      command: ["ddp-launch"]
      # ddp-launch writes the line that ends the container there (a config error, a lost
      # node, the summary): `kubectl describe pod` shows it; without one, the log's tail
      terminationMessagePath: /dev/termination-log
      terminationMessagePolicy: FallbackToLogsOnError
      args:
        - "--rendezvous-wait"
        - {{ .Values.launcher.rendezvousWaitSeconds | quote }}
        - "--relaunches"
        - {{ .Values.launcher.relaunches | quote }}
        {{- if .Values.liveness.port }}
        - "--health-port"
        - {{ .Values.liveness.port | quote }}
        {{- end }}
        - "--"
        {{- if and $trainJob (eq .Values.mode "elastic") }}
        {{- include "ddp.trainJobRendezvousArgs" . | nindent 8 }}
        {{- end }}
        - "-m"
        - "trainer"
        - "--config"
        - "/etc/ddp-trainer/config.yaml"
        {{- range .Values.trainer.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      ports:
        {{- if not $trainJob }}
        - name: pytorchjob-port
          containerPort: {{ include "ddp.rendezvousPort" . }}
          protocol: TCP
        {{- end }}
        {{- if .Values.metrics.port }}
        - name: metrics
          containerPort: {{ .Values.metrics.port }}
          protocol: TCP
        {{- end }}
        {{- if .Values.liveness.port }}
        - name: health
          containerPort: {{ .Values.liveness.port }}
          protocol: TCP
        {{- end }}
      {{- if .Values.liveness.port }}
      # ddp-launch answers 503 once a rank has been silent for twice its phase's limit and
      # not merely waiting for a peer elsewhere; a frozen pod does not answer at all
      livenessProbe:
        httpGet:
          path: /healthz
          port: health
        periodSeconds: {{ .Values.liveness.periodSeconds }}
        timeoutSeconds: {{ .Values.liveness.timeoutSeconds }}
        failureThreshold: {{ .Values.liveness.failureThreshold }}
        # a pod that fails it is hung: the pod's long grace period is for a preemption's save
        terminationGracePeriodSeconds: {{ .Values.liveness.terminationGracePeriodSeconds }}
      # the liveness probe starts once ddp-launch answers (its imports take seconds)
      startupProbe:
        httpGet:
          path: /healthz
          port: health
        periodSeconds: {{ .Values.liveness.periodSeconds }}
        timeoutSeconds: {{ .Values.liveness.timeoutSeconds }}
        failureThreshold: {{ .Values.liveness.startupFailureThreshold }}
        terminationGracePeriodSeconds: {{ .Values.liveness.terminationGracePeriodSeconds }}
      {{- end }}
      env:
        - name: TORCH_DISABLE_SHARE_RDZV_TCP_STORE
          value: "1"
        # who holds the checkpoint location's lease: this job, whichever pod or attempt
        - name: TRAINER_JOB_ID
          value: {{ include "ddp.jobId" . | quote }}
        # torchrun SIGKILLs its workers this long after SIGTERM (default 30 s): leave the
        # preemption checkpoint the grace period, less time for the kubelet's own SIGKILL
        - name: TORCH_ELASTIC_SHUTDOWN_TIMEOUT
          value: {{ max 10 (sub (int .Values.terminationGracePeriodSeconds) 15) | quote }}
        - name: TRAINER_IMAGE
          value: {{ include "ddp.image" . | quote }}
        - name: DDP_TERMINATION_MESSAGE_PATH
          value: /dev/termination-log
        - name: HOME
          value: /tmp
        - name: TMPDIR
          value: /tmp
        {{- if .Values.trainer.code }}
        # the code shipped with the job (ddp-ops --code), before the image's own packages
        - name: PYTHONPATH
          value: /opt/ddp-code
        {{- end }}
        {{- with $s3.region }}
        - name: AWS_REGION
          value: {{ . | quote }}
        {{- end }}
        {{- with $s3.endpoint }}
        - name: AWS_ENDPOINT_URL_S3
          value: {{ . | quote }}
        {{- end }}
        {{- if $s3.existingSecret }}
        # the keys as a file of the Secret's volume, never as values in the environment of
        # ddp-launch, torchrun, every rank and the checkpoint writer
        - name: AWS_SHARED_CREDENTIALS_FILE
          value: /var/run/secrets/ddp-trainer/s3/credentials
        {{- end }}
        {{- if gt (int $t.gpusPerPod) 0 }}
        {{- include "ddp.ncclEnv" . | nindent 8 }}
        {{- include "ddp.cudaEnv" . | nindent 8 }}
        {{- end }}
        {{- with .Values.trainer.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if not $trainJob }}
      resources:
        {{- include "ddp.resources" . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: /etc/ddp-trainer
          readOnly: true
        - name: dshm
          mountPath: /dev/shm
        - name: tmp
          mountPath: /tmp
        {{- if .Values.trainer.code }}
        - name: code
          mountPath: /opt/ddp-code
          readOnly: true
        {{- end }}
        {{- if not $s3.bucket }}
        - name: checkpoints
          mountPath: /checkpoints
        {{- end }}
        {{- if $s3.existingSecret }}
        - name: s3-credentials
          mountPath: /var/run/secrets/ddp-trainer/s3
          readOnly: true
        {{- end }}
  volumes:
    - name: config
      configMap:
        name: {{ include "ddp.fullname" . }}-config
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ include "ddp.shmSizeLimit" . }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ .Values.tmpSize }}
    {{- with .Values.trainer.code }}
    - name: code
      configMap:
        name: {{ include "ddp.fullname" $ }}-code
        items:
          {{- range $index, $file := . }}
          - key: {{ printf "f%04d" $index }}
            path: {{ $file.path }}
          {{- end }}
    {{- end }}
    {{- if not $s3.bucket }}
    - name: checkpoints
      {{- if $checkpoint.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ $checkpoint.existingClaim }}
      {{- else }}
      emptyDir: {}
      {{- end }}
    {{- end }}
    {{- if $s3.existingSecret }}
    - name: s3-credentials
      secret:
        secretName: {{ $s3.existingSecret }}
        # readable by the pod's group (fsGroup) only
        defaultMode: 0440
        # a Secret without the key starts the pod anyway: the trainer's probe of the location
        # then says in one line which file is missing, where a missing key would leave the pod
        # in ContainerCreating (pkg/volume/secret/secret.go, MakePayload)
        optional: true
        items:
          - key: {{ $s3.credentialsKey | default "credentials" }}
            path: credentials
    {{- end }}
{{- end -}}

{{/* The trainer container's requests and limits: `resources` over the chart's sizing
(cpuResources on CPU pods; on GPU pods gpuResources per GPU, memory plus /dev/shm's limit);
GPUs (and RDMA devices) from `gpus`. A PyTorchJob's container resources, a TrainJob's
trainer.resourcesPerNode. */}}
{{- define "ddp.resources" -}}
{{- $t := include "ddp.topology" . | fromJson -}}
{{- $gpus := int $t.gpusPerPod }}
{{- $sized := deepCopy .Values.cpuResources }}
{{- if gt $gpus 0 }}
{{- $g := .Values.gpuResources }}
{{- $memory := printf "%dMi" (add (mul $gpus (include "ddp.mebibytes" $g.memory)) (include "ddp.mebibytes" (include "ddp.shmSizeLimit" .))) }}
{{- $sized = dict "requests" (dict "cpu" (toString (mul $gpus (int $g.cpu))) "memory" $memory) "limits" (dict "memory" $memory) }}
{{- end }}
{{- $resources := mergeOverwrite $sized (deepCopy .Values.resources) }}
{{- if gt $gpus 0 }}
{{- $limits := default dict $resources.limits }}
{{- $_ := set $limits "nvidia.com/gpu" (toString $gpus) }}
{{- if .Values.nccl.rdma.enabled }}
{{- $_ := set $limits .Values.nccl.rdma.resourceName (toString .Values.nccl.rdma.count) }}
{{- end }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- toYaml $resources }}
{{- end -}}

{{/* torchrun's c10d rendezvous under a TrainJob, at the address Trainer v2 gives node 0
(PET_MASTER_ADDR:PET_MASTER_PORT, pkg/runtime/framework/plugins/torch/torch.go:158-165),
for a fixed node count (PET_NNODES): v2 injects only a static rendezvous, which cannot
restart one node's workers (docs/facts.md). Kubernetes expands $(VAR) in args from the
container's environment. */}}
{{- define "ddp.trainJobRendezvousArgs" -}}
- "--rdzv-backend=c10d"
- "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"
- {{ printf "--rdzv-id=%s" (printf "%s-%s" .Release.Namespace (include "ddp.fullname" .) | trunc 63) | quote }}
- {{ printf "--max-restarts=%d" (int .Values.elastic.maxRestarts) | quote }}
{{- $conf := list }}
{{- range $key, $value := merge (dict) .Values.elastic.rdzvConf (dict "join_timeout" .Values.launcher.rendezvousWaitSeconds) }}
{{- $conf = append $conf (printf "%s=%v" $key $value) }}
{{- end }}
- {{ printf "--rdzv-conf=%s" (join "," $conf) | quote }}
{{- end -}}

{{/* What the pods' values may not say, each refused in one line: S3 keys as environment
variables (the chart's former accessKeyIdKey and secretAccessKeyKey), and mode=fixed in a
namespace that enforces the restricted Pod Security Standard, which would refuse the v1
operator's init container. */}}
{{- define "ddp.podChecks" -}}
{{- with .Values.kueue.topology.level -}}
{{- if not $.Values.kueue.queueName -}}
{{- fail (printf "kueue.topology.level=%s: only Kueue reads it, and the job goes to no Kueue queue; set kueue.queueName too" .) -}}
{{- end -}}
{{- /* what Kueue's webhook takes (ValidateLabelName, jobframework/tas_validation.go:62-65) */ -}}
{{- $name := splitList "/" . | last -}}
{{- $prefix := trimSuffix (printf "/%s" $name) . -}}
{{- if or (gt (len (splitList "/" .)) 2) (gt (len $name) 63) (not (regexMatch "^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" $name)) (and (ne $prefix .) (or (gt (len $prefix) 253) (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" $prefix)))) -}}
{{- fail (printf "kueue.topology.level=%s: not a node label name, which Kueue refuses; give your Topology's level label, e.g. kubernetes.io/hostname" .) -}}
{{- end -}}
{{- end -}}
{{- $s3 := (include "ddp.checkpointValues" . | fromJson).s3 -}}
{{- range $key := list "accessKeyIdKey" "secretAccessKeyKey" -}}
{{- if hasKey $s3 $key -}}
{{- fail (printf "checkpoint.s3.%s=%v: the pods no longer get S3 keys as environment variables, only as a credentials file: put one in the Secret (kubectl create secret generic %s --from-file=credentials=FILE, FILE holding [default] aws_access_key_id and aws_secret_access_key), drop accessKeyIdKey and secretAccessKeyKey, and set checkpoint.s3.credentialsKey if its key is not `credentials`" $key (get $s3 $key) (default "NAME" $s3.existingSecret)) -}}
{{- end -}}
{{- end -}}
{{- if and (eq .Values.podSecurityStandard "restricted") (eq .Values.mode "fixed") (eq .Values.jobKind "PyTorchJob") -}}
{{- fail "mode=fixed with podSecurityStandard=restricted: the v1 operator gives fixed-mode workers an init container with no securityContext (init-pytorch), which the restricted standard refuses, and the chart cannot change it; use mode=elastic (the default), or jobKind=TrainJob" -}}
{{- end -}}
{{- end -}}
