{{/*
Names, labels and small pieces shared by the templates.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "sessionfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: fullnameOverride, or the release name, plus the chart
name unless the release name already contains it. Truncated so that the longest suffix
("-operator-metrics") still fits in 63 characters.
*/}}
{{- define "sessionfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 46 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sessionfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels that select one component's pods: stable across upgrades. With a `shard` (an
operator shard's name, see operatorShards), also that shard's label, so that the
shards' Deployments select disjoint pods.
*/}}
{{- define "sessionfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sessionfleet.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with get . "shard" }}
sessionfleet.dev/shard: {{ . }}
{{- end }}
{{- end }}

{{/* The labels every object carries, except the CRDs (see crdLabels). */}}
{{- define "sessionfleet.labels" -}}
{{ include "sessionfleet.crdLabels" .root }}
app.kubernetes.io/name: {{ include "sessionfleet.name" .root }}
app.kubernetes.io/part-of: sessionfleet
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- with get . "shard" }}
sessionfleet.dev/shard: {{ . }}
{{- end }}
{{- end }}

{{/*
The labels the generated CRD templates add to their own app.kubernetes.io/part-of.
*/}}
{{- define "sessionfleet.crdLabels" -}}
helm.sh/chart: {{ include "sessionfleet.chart" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The CRDs' annotations: with crds.keep, Helm's keep policy, and Argo CD's equivalent
(Argo CD does not read Helm's annotation), so neither `helm uninstall` nor an Argo CD
prune deletes the CRDs and with them every object of their kinds.
*/}}
{{- define "sessionfleet.crdAnnotations" -}}
{{- if .Values.crds.keep }}
helm.sh/resource-policy: keep
argocd.argoproj.io/sync-options: Delete=false
{{- end }}
{{- end }}

{{/* The image reference: the digest wins over the tag; the tag defaults to appVersion. */}}
{{- define "sessionfleet.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* ServiceAccount names. */}}
{{- define "sessionfleet.serviceAccountName" -}}
{{- $sa := index .root.Values .component "serviceAccount" }}
{{- if $sa.create }}
{{- default (printf "%s-%s" (include "sessionfleet.fullname" .root) .component) $sa.name }}
{{- else }}
{{- required (printf "%s.serviceAccount.name is required when %s.serviceAccount.create is false" .component .component) $sa.name }}
{{- end }}
{{- end }}

{{/*
The operator replicas' leader-election Lease, in the release namespace:
operator.leaderElection.leaseName, or `<fullname>-operator`.
*/}}
{{- define "sessionfleet.operatorLeaseName" -}}
{{- default (printf "%s-operator" (include "sessionfleet.fullname" .)) .Values.operator.leaderElection.leaseName }}
{{- end }}

{{/*
The operator Deployments, as a JSON list of {name, namespaces} (read it with
fromJsonArray): one per entry of operator.shards, or, without shards, the one operator
with an empty name, serving operator.watchNamespaces (empty: the whole cluster). An
empty name adds nothing to object names, labels or the Lease's name.
*/}}
{{- define "sessionfleet.operatorShards" -}}
{{- if .Values.operator.shards }}
{{- toJson .Values.operator.shards }}
{{- else }}
{{- toJson (list (dict "name" "" "namespaces" .Values.operator.watchNamespaces)) }}
{{- end }}
{{- end }}

{{/*
Every namespace the operator serves through a Role: operator.watchNamespaces, or the
namespaces of all the shards. Empty: the operator serves the whole cluster. A JSON list.
*/}}
{{- define "sessionfleet.operatorNamespaces" -}}
{{- $namespaces := .Values.operator.watchNamespaces }}
{{- range .Values.operator.shards }}
{{- $namespaces = concat $namespaces .namespaces }}
{{- end }}
{{- toJson $namespaces }}
{{- end }}

{{/*
A shard's leader-election Lease, `<operatorLeaseName>-<shard>`; with no shard (an empty
name), operatorLeaseName itself. Takes (dict "root" $ "shard" NAME).
*/}}
{{- define "sessionfleet.operatorShardLeaseName" -}}
{{- include "sessionfleet.operatorLeaseName" .root }}{{ with .shard }}-{{ . }}{{ end }}
{{- end }}

{{/*
Render-time checks of operator.shards that values.schema.json cannot express (and, for
a chart installed with --skip-schema-validation, those it does). Renders nothing.
*/}}
{{- define "sessionfleet.validateOperatorShards" -}}
{{- $shards := .Values.operator.shards }}
{{- if and $shards .Values.operator.watchNamespaces }}
{{- fail "operator.shards and operator.watchNamespaces are both set: use one or the other. With shards, each shard serves the namespaces it lists; move the namespaces of operator.watchNamespaces into the shards." }}
{{- end }}
{{- $names := dict }}
{{- $owners := dict }}
{{- $prefix := printf "%s-operator-" (include "sessionfleet.fullname" .) }}
{{- range $shard := $shards }}
{{- $name := required "operator.shards: every shard needs a name" $shard.name }}
{{- if hasKey $names $name }}
{{- fail (printf "operator.shards: two shards are named %q: each shard needs a name of its own (it names the shard's Deployment, PodDisruptionBudget and Lease)." $name) }}
{{- end }}
{{- $_ := set $names $name true }}
{{- if gt (len (printf "%s%s" $prefix $name)) 63 }}
{{- fail (printf "operator.shards: the Deployment of shard %q, %q, is longer than 63 characters: shorten the shard's name, or the release's name (fullnameOverride)." $name (printf "%s%s" $prefix $name)) }}
{{- end }}
{{- if not $shard.namespaces }}
{{- fail (printf "operator.shards: shard %q has no namespaces: list the namespaces it serves, or remove the shard." $name) }}
{{- end }}
{{- range $namespace := $shard.namespaces }}
{{- with get $owners $namespace }}
{{- if eq . $name }}
{{- fail (printf "operator.shards: namespace %q is listed twice in shard %q." $namespace $name) }}
{{- end }}
{{- fail (printf "operator.shards: namespace %q is in shard %q and in shard %q: a namespace must belong to exactly one shard, or two leaders would act on its objects at once." $namespace . $name) }}
{{- end }}
{{- $_ := set $owners $namespace $name }}
{{- end }}
{{- end }}
{{- end }}

{{/* The namespace the router serves (and where its Role lives). */}}
{{- define "sessionfleet.routerNamespace" -}}
{{- default .Release.Namespace .Values.router.namespace }}
{{- end }}

{{/*
The namespace the Endpoint Picker serves, where all its objects live: an InferencePool
names its Endpoint Picker's Service in its own namespace only. epp.namespace, else the
router's namespace (router.namespace, else the release namespace).
*/}}
{{- define "sessionfleet.eppNamespace" -}}
{{- default (include "sessionfleet.routerNamespace" .) .Values.epp.namespace }}
{{- end }}

{{/*
The slot Leases of the router's or the Endpoint Picker's replicas (fronts/handshake.py,
LeaseKeeper): each replica holds one of `<fullname>-<component>-0` … `-<count-1>`, so
that the component's Role can name them in resourceNames and never reaches another
Lease of its namespace, the operator's leader Lease above all. Takes (dict "root" $
"component" "router"|"epp"); renders {"prefix": …, "count": …} as JSON (read it with
fromJson). The count is <component>.leaseSlots, or with 0 twice the most replicas
(autoscaling.maxReplicas when the router autoscales) plus 2, and at least 8.
*/}}
{{- define "sessionfleet.leaseSlots" -}}
{{- $values := get .root.Values .component }}
{{- $most := int $values.replicas }}
{{- if and (hasKey $values "autoscaling") $values.autoscaling.enabled }}
{{- $most = max $most (int $values.autoscaling.maxReplicas) | int }}
{{- end }}
{{- $count := int $values.leaseSlots }}
{{- if eq $count 0 }}
{{- $count = max 8 (add (mul 2 $most) 2) | int }}
{{- else if le $count $most }}
{{- fail (printf "%s.leaseSlots is %d but up to %d %s replicas run, plus one more during a rolling update: each replica holds a Lease slot of its own, and one without a slot is not waited for when a session migrates. Raise %s.leaseSlots above %d, or set it to 0 for the default." .component $count $most .component .component $most) }}
{{- end }}
{{- toJson (dict "prefix" (printf "%s-%s" (include "sessionfleet.fullname" .root) .component) "count" $count) }}
{{- end }}

{{/*
The Role rules of the router's or the Endpoint Picker's Lease slots. Takes the same
dict as sessionfleet.leaseSlots.
*/}}
{{- define "sessionfleet.leaseSlotRules" -}}
{{- $slots := include "sessionfleet.leaseSlots" . | fromJson }}
# LeaseKeeper (fronts/handshake.py) holds one Lease of a fixed set of slots and renews
# it, so the operator knows which replicas must acknowledge a migration. RBAC cannot
# scope a create by name (the name is in the body, not the URL), so create is a rule of
# its own; get and patch (re-read a slot, take an expired one over, renew, release)
# reach the slots by name only, never the operator's leader Lease beside them.
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, patch]
  resourceNames:
    {{- range $index := until (int $slots.count) }}
    - {{ $slots.prefix }}-{{ $index }}
    {{- end }}
{{- end }}

{{/* The flags that point a router or Endpoint Picker replica at its Lease slots. */}}
{{- define "sessionfleet.leaseSlotArgs" -}}
{{- $slots := include "sessionfleet.leaseSlots" . | fromJson }}
- --lease-prefix={{ $slots.prefix }}
- --lease-slots={{ int $slots.count }}
{{- end }}

{{/*
Who may reach a worker's engine port: the operator keeps a NetworkPolicy per worker
admitting only these (`--engine-peers`, controllers/workers.py). The operator (it
scrapes and calls engines), the routers, the node agents, the gateway's proxies that
call the Endpoint Picker (networkPolicy.eppFrom: they forward the turns to the engines)
and networkPolicy.workers.extraFrom. A JSON list of NetworkPolicyPeer objects.
*/}}
{{- define "sessionfleet.enginePeers" -}}
{{- $release := dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace) }}
{{- $components := list "operator" }}
{{- if .Values.router.enabled }}{{ $components = append $components "router" }}{{ end }}
{{- if .Values.agent.enabled }}{{ $components = append $components "agent" }}{{ end }}
{{- $peers := list }}
{{- range $components }}
{{- $selector := include "sessionfleet.selectorLabels" (dict "root" $ "component" .) | fromYaml }}
{{- $peers = append $peers (dict "namespaceSelector" $release "podSelector" (dict "matchLabels" $selector)) }}
{{- end }}
{{- if .Values.epp.enabled }}
{{- $peers = concat $peers .Values.networkPolicy.eppFrom }}
{{- end }}
{{- toJson (concat $peers .Values.networkPolicy.workers.extraFrom) }}
{{- end }}

{{/* The namespace of the default DrainPolicy. */}}
{{- define "sessionfleet.drainPolicyNamespace" -}}
{{- default (include "sessionfleet.routerNamespace" .) .Values.defaultDrainPolicy.namespace }}
{{- end }}

{{/*
The pod-level fields shared by the operator and router pods: security context,
pull secrets and a memory-backed /tmp (the root filesystem is read-only).
*/}}
{{- define "sessionfleet.podSecurity" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "sessionfleet.tmpVolume" -}}
- name: tmp
  emptyDir:
    medium: Memory
    sizeLimit: 64Mi
{{- end }}

{{- define "sessionfleet.tmpMount" -}}
- name: tmp
  mountPath: /tmp
{{- end }}

{{/*
The node agents' shared token (the Secret agent.tokenSecret, key `token`): mounted in
the agent pods and, when the operator calls the agents, in the operator pod.
*/}}
{{- define "sessionfleet.agentTokenFile" -}}
/etc/sessionfleet/agent-token/token
{{- end }}

{{- define "sessionfleet.agentTokenVolume" -}}
- name: agent-token
  secret:
    secretName: {{ .Values.agent.tokenSecret }}
    items:
      - key: token
        path: token
{{- end }}

{{- define "sessionfleet.agentTokenMount" -}}
- name: agent-token
  mountPath: {{ include "sessionfleet.agentTokenFile" . | dir }}
  readOnly: true
{{- end }}

{{/* Whether the operator calls the node agents: the criu driver. */}}
{{- define "sessionfleet.operatorCallsAgents" -}}
{{- if and .Values.agent.enabled .Values.agent.criu }}true{{ end }}
{{- end }}

{{/*
Whether the agents check callers with TokenReviews (the default): the operator presents
a token of its ServiceAccount for each node's audience. Not with agent.tokenSecret (the
static token), and not for an agent that authenticates nobody (telemetry alone).
*/}}
{{- define "sessionfleet.agentReviewsTokens" -}}
{{- if and .Values.agent.enabled (not .Values.agent.tokenSecret) (or .Values.agent.criu .Values.agent.metricsReaders) }}true{{ end }}
{{- end }}

{{/* The operator's user name, which the agents trust (--operator). */}}
{{- define "sessionfleet.operatorUserName" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "sessionfleet.serviceAccountName" (dict "root" . "component" "operator") }}
{{- end }}

{{/* The agents' certificate from agent.tls.secret: tls.crt and tls.key, and ca.crt. */}}
{{- define "sessionfleet.agentTLSDir" -}}
/etc/sessionfleet/agent-tls
{{- end }}

{{- define "sessionfleet.agentTLSVolume" -}}
- name: agent-tls
  secret:
    secretName: {{ .root.Values.agent.tls.secret }}
    items:
      {{- range .keys }}
      - key: {{ . }}
        path: {{ . }}
      {{- end }}
{{- end }}

{{- define "sessionfleet.agentTLSMount" -}}
- name: agent-tls
  mountPath: {{ include "sessionfleet.agentTLSDir" . }}
  readOnly: true
{{- end }}

{{- /*
The Secret whose key signs the WorkerCheckpoints the operator creates (docs/checkpoints.md,
Provenance). The operator creates it in the release namespace; every replica and shard
reads the same one.
*/ -}}
{{- define "sessionfleet.checkpointKeySecretName" -}}
{{- printf "%s-checkpoint-key" (include "sessionfleet.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
