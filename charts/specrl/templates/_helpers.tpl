{{/* Chart name, truncated to the 63 characters a label value may hold. */}}
{{- define "specrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's resources: <release>-specrl, or the release name when it already says specrl. */}}
{{- define "specrl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specrl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object of the release carries (Helm's recommended set). */}}
{{- define "specrl.labels" -}}
helm.sh/chart: {{ include "specrl.chart" . }}
{{ include "specrl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specrl
{{- end }}

{{/* Immutable subset used by selectors: never add labels here, a Deployment's selector cannot change. */}}
{{- define "specrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "specrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specrl.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag, or repository@digest when a digest pins the image. */}}
{{- define "specrl.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Namespace of an optional monitoring object: its own setting, else the release namespace. */}}
{{- define "specrl.namespaceOr" -}}
{{- default .root.Release.Namespace .ns }}
{{- end }}

{{/*
RBAC: exactly what the operator calls (operator/rbac.py RBAC_RULES is the source of truth; a test compares
the rendered rules with it). Namespaced rules go into a ClusterRole (all namespaces) or one Role per watched
namespace; the cluster rules are what kopf needs to discover resources (and namespaces, when it watches named
ones) and the nodes of lost pods.
*/}}
{{- define "specrl.rbac.namespacedRules" -}}
- apiGroups: ["specrl.io"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["specrl.io"]
  resources: ["rljobs/status"]
  verbs: ["get", "patch"]
# blockOwnerDeletion on the children's ownerReferences needs it under OwnerReferencesPermissionEnforcement.
- apiGroups: ["specrl.io"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{- define "specrl.rbac.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get"]
{{- if .Values.watchNamespaces }}
# kopf lists and watches namespaces only when it does not run cluster-wide.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/* kopf peering (only with operator.peering): cluster-wide peering objects, or per-namespace ones. */}}
{{- define "specrl.rbac.peeringClusterRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- define "specrl.rbac.peeringNamespacedRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{/*
kopf peering name: `operator.peering`, or the release's full name as soon as more than one replica runs (two
unpeered kopf operators would both reconcile every RLJob). Empty: standalone.
*/}}
{{- define "specrl.peering" -}}
{{- if .Values.operator.peering -}}
{{- .Values.operator.peering -}}
{{- else if gt (int .Values.replicaCount) 1 -}}
{{- include "specrl.fullname" . -}}
{{- end -}}
{{- end }}
