{{/* The name of every object: the release's, with walbox in it once. */}}
{{- define "walbox.fullname" -}}
{{- if contains "walbox" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-walbox" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "walbox.selectorLabels" -}}
app.kubernetes.io/name: walbox
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "walbox.labels" -}}
{{ include "walbox.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "walbox.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "walbox.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "walbox.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
walbox.yaml for the ConfigMap. Secrets are refused here: a ConfigMap is
readable by whoever may list the namespace's configuration.
*/}}
{{- define "walbox.config" -}}
{{- $c := deepCopy .Values.config -}}
{{- $pg := default dict $c.postgres -}}
{{- if and $pg.url (regexMatch "^postgres(ql)?://[^/@]*:[^/@]*@" $pg.url) -}}
{{- fail "config.postgres.url carries a password: it would land in a ConfigMap; put it in a Secret and set secrets.postgresPassword" -}}
{{- end -}}
{{- if and $pg.url (regexMatch "password\\s*=" $pg.url) -}}
{{- fail "config.postgres.url carries a password: it would land in a ConfigMap; put it in a Secret and set secrets.postgresPassword" -}}
{{- end -}}
{{- $nats := default dict $c.nats -}}
{{- if or $nats.password $nats.token -}}
{{- fail "config.nats.password / config.nats.token would land in a ConfigMap; set secrets.natsPassword (or mount a credentials file with secrets.files)" -}}
{{- end -}}
{{- $kafka := default dict $c.kafka -}}
{{- if and $kafka.sasl $kafka.sasl.password -}}
{{- fail "config.kafka.sasl.password would land in a ConfigMap; set secrets.kafkaSaslPassword" -}}
{{- end -}}
{{- $archive := default dict $c.archive -}}
{{- if and $archive.s3 $archive.s3.secret_key -}}
{{- fail "config.archive.s3.secret_key would land in a ConfigMap; set AWS_SECRET_ACCESS_KEY through extraEnv from a Secret" -}}
{{- end -}}
{{- $metrics := default dict $c.metrics -}}
{{- $_ := set $metrics "listen" (printf "0.0.0.0:%d" (int .Values.metrics.port)) -}}
{{- $_ := set $c "metrics" $metrics -}}
{{- toYaml $c -}}
{{- end -}}

{{/* The volumes the walbox container mounts. */}}
{{- define "walbox.volumes" -}}
- name: walbox-config
  configMap:
    name: {{ include "walbox.fullname" . }}
- name: tmp
  emptyDir:
    sizeLimit: 64Mi
{{- with .Values.secrets.postgresPassword }}
{{- if .secretName }}
- name: postgres-password
  secret:
    secretName: {{ .secretName }}
    defaultMode: 0440
    items:
      - key: {{ .key }}
        path: password
{{- end }}
{{- end }}
{{- range $i, $f := .Values.secrets.files }}
- name: secret-files-{{ $i }}
  secret:
    secretName: {{ $f.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/*
The walbox container, for the standalone Deployment and for an
application's pod (sidecar): add it to your pod with the volumes of
"walbox.volumes".
*/}}
{{- define "walbox.container" -}}
name: walbox
image: {{ include "walbox.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args: ["run", "--config", "/etc/walbox/config/walbox.yaml"]
env:
{{- with .Values.secrets.postgresPassword }}
{{- if .secretName }}
  - name: WALBOX_POSTGRES_PASSWORD_FILE
    value: /etc/walbox/secrets/postgres/password
{{- end }}
{{- end }}
{{- with .Values.secrets.natsPassword }}
{{- if .secretName }}
  - name: WALBOX_NATS_PASSWORD
    valueFrom:
      secretKeyRef:
        name: {{ .secretName }}
        key: {{ .key }}
{{- end }}
{{- end }}
{{- with .Values.secrets.kafkaSaslPassword }}
{{- if .secretName }}
  - name: WALBOX_KAFKA_SASL_PASSWORD
    valueFrom:
      secretKeyRef:
        name: {{ .secretName }}
        key: {{ .key }}
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . | indent 2 }}
{{- end }}
ports:
  - name: walbox-metrics
    containerPort: {{ .Values.metrics.port }}
    protocol: TCP
livenessProbe:
  httpGet:
    path: /healthz
    port: walbox-metrics
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: walbox-metrics
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
resources:
{{ toYaml .Values.resources | indent 2 }}
securityContext:
{{ toYaml .Values.securityContext | indent 2 }}
volumeMounts:
  - name: walbox-config
    mountPath: /etc/walbox/config
    readOnly: true
  - name: tmp
    mountPath: /tmp
{{- if .Values.secrets.postgresPassword.secretName }}
  - name: postgres-password
    mountPath: /etc/walbox/secrets/postgres
    readOnly: true
{{- end }}
{{- range $i, $f := .Values.secrets.files }}
  - name: secret-files-{{ $i }}
    mountPath: {{ $f.mountPath }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* Pod-level settings shared by the Deployment and the example. */}}
{{- define "walbox.podSpecCommon" -}}
serviceAccountName: {{ include "walbox.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext:
{{ toYaml .Values.podSecurityContext | indent 2 }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
{{ toYaml . | indent 2 }}
{{- end }}
{{- end -}}
