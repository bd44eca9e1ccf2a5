{{/* The pod template shared by Master and Worker replicas. */}}
{{- define "ddp.podTemplate" -}}
{{- $t := include "ddp.topology" . | fromJson -}}
{{- $s3 := .Values.checkpoints.s3 -}}
metadata:
  labels:
    {{- include "ddp.selectorLabels" . | nindent 4 }}
    app.kubernetes.io/component: trainer
  annotations:
    checksum/config: {{ include "ddp.trainerConfig" . | sha256sum }}
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "ddp.serviceAccountName" . }}
  automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
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
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: pytorch
      image: "{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}"
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      # exec form: SIGTERM reaches ddp-launch, which forwards it to torchrun and the workers;
      # ddp-launch checks the config first and waits for the rendezvous host (values.yaml)
      command: ["ddp-launch"]
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
        - "-m"
        - "trainer"
        - "--config"
        - "/etc/ddp-trainer/config.yaml"
        {{- range .Values.trainer.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      ports:
        - name: pytorchjob-port
          containerPort: {{ .Values.port }}
          protocol: TCP
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
          value: {{ printf "%s/%s" .Release.Namespace (include "ddp.fullname" .) | quote }}
        # torchrun SIGKILLs its workers this long after SIGTERM (default 30 s): leave the
        # preemption checkpoint the grace period, less time for the kubelet's own SIGKILL
        - name: TORCH_ELASTIC_SHUTDOWN_TIMEOUT
          value: {{ max 10 (sub (int .Values.terminationGracePeriodSeconds) 15) | quote }}
        - name: TRAINER_IMAGE
          value: "{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}"
        - name: HOME
          value: /tmp
        - name: TMPDIR
          value: /tmp
        {{- with $s3.region }}
        - name: AWS_REGION
          value: {{ . | quote }}
        {{- end }}
        {{- with $s3.endpoint }}
        - name: AWS_ENDPOINT_URL_S3
          value: {{ . | quote }}
        {{- end }}
        {{- if $s3.existingSecret }}
        - name: AWS_ACCESS_KEY_ID
          valueFrom:
            secretKeyRef:
              name: {{ $s3.existingSecret }}
              key: {{ $s3.accessKeyIdKey }}
        - name: AWS_SECRET_ACCESS_KEY
          valueFrom:
            secretKeyRef:
              name: {{ $s3.existingSecret }}
              key: {{ $s3.secretAccessKeyKey }}
        {{- end }}
        {{- if gt (int $t.gpusPerPod) 0 }}
        {{- include "ddp.ncclEnv" . | nindent 8 }}
        {{- end }}
        {{- with .Values.trainer.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        {{- $resources := deepCopy .Values.resources }}
        {{- if gt (int $t.gpusPerPod) 0 }}
        {{- $limits := merge (dict "nvidia.com/gpu" (toString $t.gpusPerPod)) (default dict $resources.limits) }}
        {{- if .Values.nccl.rdma.enabled }}
        {{- $_ := set $limits .Values.nccl.rdma.resourceName (toString .Values.nccl.rdma.count) }}
        {{- end }}
        {{- $_ := set $resources "limits" $limits }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
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
        {{- if not $s3.bucket }}
        - name: checkpoints
          mountPath: /checkpoints
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
    {{- if not $s3.bucket }}
    - name: checkpoints
      {{- if .Values.checkpoints.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ .Values.checkpoints.existingClaim }}
      {{- else }}
      emptyDir: {}
      {{- end }}
    {{- end }}
{{- end -}}
