"""The Kubernetes pod fields of an RLJob: a common pod template plus per-role overrides.

These are the structures RayJob and PyTorchJob users already write (`volumes`, `volumeMounts`, `env` with
`valueFrom`, `envFrom`, `imagePullSecrets`, `affinity`, `topologySpreadConstraints`, `schedulerName`,
`runtimeClassName`, ...), with Kubernetes' own field names and shapes, so a block can be pasted from a Pod or a
RayJob. They are validated as Kubernetes validates them (one volume source per volume, one source per
`valueFrom`, operator enums, label-selector shapes) and reported with exact field paths; the operator copies
them into the pods verbatim and adds its own fields (security context, ports, the job's ConfigMap) around them.

Merging a role's override (`spec.resources.{coordinator,trainer,rollout}.podTemplate`) over the common
`spec.resources.podTemplate` (`merge_templates`):

* placement and sizing — `nodeSelector`, `tolerations`, `affinity`, `topologySpreadConstraints`, `resources`,
  `schedulerName`, `runtimeClassName`, `priorityClassName`, `serviceAccountName`, `imagePullPolicy` — are
  *replaced whole* when the role sets them (`nodeSelector: {}` on the coordinator drops the GPU-node selector);
* additive fields — `env`, `envFrom`, `volumes`, `volumeMounts`, `imagePullSecrets`, `labels`,
  `annotations` — are *merged*, the role's entry winning on the same key (name, mountPath, label key).

`hostPath` volumes are refused unless the template that declares them sets `allowHostPath: true`: they break
the restricted Pod Security Standard every operator-made field keeps, and they tie a job to one node.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from .api_base import (
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    ENV_NAME,
    LABEL_NAME,
    MAX_ITEMS,
    MAX_LABEL,
    MAX_PATH,
    MAX_REF,
    MAX_VALUE,
    QUALIFIED_NAME_CEL,
    LabelValue,
    Quantity,
    _cel,
    _raise,
    _Strict,
)

GPU_RESOURCE = "nvidia.com/gpu"
# Volumes and paths the operator puts in every pod (operator/children.py); user volumes may not take them.
RESERVED_VOLUMES = ("config", "cache", "dshm")
RESERVED_MOUNT_PATHS = ("/etc/specrl", "/dev/shm")
ROLES = ("coordinator", "trainer", "rollout")
MAX_NAME = 253  # object names (DNS-1123 subdomains)
# Container resource names without a domain prefix (plus hugepages-<size>); anything else is an extended resource.
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage")
MAX_ANNOTATIONS_BYTES = 256 * 1024  # the API server's limit on all of an object's annotations together

_Name = Field(min_length=1, max_length=MAX_NAME, description="Object name.")


def _one_of(fields: tuple[str, ...], what: str) -> tuple[str, str, None]:
    """A CEL rule: exactly one of `fields` is set."""
    count = " + ".join(f"(has(self.{f}) ? 1 : 0)" for f in fields)
    return (f"{count} == 1", f"exactly one of {', '.join(fields)} must be set ({what})", None)


def _count_set(model: Any, names: tuple[str, ...]) -> int:
    return sum(getattr(model, n) is not None for n in names)


def qualified_name_problem(key: str) -> str | None:
    """Why `key` is not a Kubernetes qualified name (a label or annotation key), as the API server says it."""
    parts = key.split("/")
    if len(parts) > 2:
        return "must be a name with an optional DNS subdomain prefix and '/', e.g. example.com/my-name"
    if len(parts) == 2 and (not parts[0] or len(parts[0]) > MAX_NAME or not DNS1123_SUBDOMAIN.fullmatch(parts[0])):
        return (f"prefix {parts[0]!r} must be a DNS subdomain (lower-case alphanumerics, '-' and '.', at most "
                f"{MAX_NAME} characters)")
    name = parts[-1]
    if not name:
        return "name part must be non-empty"
    if len(name) > MAX_LABEL:
        return f"name part must be at most {MAX_LABEL} characters (has {len(name)})"
    if not LABEL_NAME.fullmatch(name):
        return ("name part must consist of alphanumerics, '-', '_' or '.', starting and ending with an "
                "alphanumeric")
    return None


def resource_name_problem(name: str) -> str | None:
    """Why `name` is not a container resource name the API server accepts."""
    problem = qualified_name_problem(name)
    if problem is None and "/" not in name and name not in STANDARD_RESOURCES and not name.startswith("hugepages-"):
        problem = (f"not a standard resource ({', '.join(STANDARD_RESOURCES)}, hugepages-<size>); extended "
                   "resources need a domain prefix, e.g. example.com/fpga")
    return problem


def _keys_cel(field: str, what: str, *, any_case: bool = False) -> tuple[str, str, str]:
    """A CEL rule: every key of the map `field` is a qualified name (`any_case`: once lower-cased)."""
    pattern = "(?i)" + QUALIFIED_NAME_CEL if any_case else QUALIFIED_NAME_CEL
    return (f"!has(self.{field}) || self.{field}.all(k, k.matches('{pattern}'))",
            (f"{what} must be qualified names: [DNS subdomain prefix '/'] then at most {MAX_LABEL} alphanumerics, "
             "'-', '_' or '.', starting and ending with an alphanumeric"), f".{field}")


def _overlaps_cel(var: str, reserved: tuple[str, ...]) -> str:
    """CEL twin of the mountPath overlap check of `PodTemplate`: `var` (trailing slashes ignored) is a reserved
    path, lies under one, or is an ancestor of one."""
    terms = [t for p in reserved for t in (f"{var} == '{p}'", f"{var}.startsWith('{p}/')")]
    ancestors = sorted({p.rsplit("/", i)[0] for p in reserved for i in range(1, p.count("/"))})
    if ancestors:
        terms.append(f"{var}.matches('^({'|'.join(ancestors)})/*$')")
    return " || ".join(terms)


# --------------------------------------------------------------------------------------------------------
# Scheduling


class Toleration(_Strict):
    """A Kubernetes toleration."""

    key: str | None = Field(default=None, max_length=MAX_NAME, description=(
        "Taint key (empty with operator Exists: all taints)."))
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=MAX_REF, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(default=None, description=(
        "Taint effect to match; null = all effects."))
    toleration_seconds: int | None = Field(default=None, ge=0, description="For NoExecute: seconds to stay bound.")


class NodeSelectorRequirement(_Strict):
    """A node label (or field) requirement."""

    key: str = Field(min_length=1, max_length=MAX_REF, description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(description=(
        "In, NotIn, Exists, DoesNotExist, Gt or Lt."))
    values: list[str] | None = Field(default=None, max_length=MAX_ITEMS, description="Values (In, NotIn, Gt, Lt).")


class NodeSelectorTerm(_Strict):
    """Requirements that must all hold (ANDed)."""

    match_expressions: list[NodeSelectorRequirement] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Requirements on node labels."))
    match_fields: list[NodeSelectorRequirement] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Requirements on node fields."))


class NodeSelector(_Strict):
    """Terms of which at least one must hold (ORed)."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, max_length=MAX_ITEMS, description="Terms.")


class PreferredSchedulingTerm(_Strict):
    """A weighted node preference."""

    weight: int = Field(ge=1, le=100, description="Weight 1-100.")
    preference: NodeSelectorTerm = Field(description="The preferred node term.")


class NodeAffinity(_Strict):
    """Node affinity."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(default=None, description=(
        "Nodes the pod must run on."))
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None = Field(
        default=None, max_length=MAX_ITEMS, description="Nodes the pod prefers.")


class LabelSelectorRequirement(_Strict):
    """A label requirement."""

    key: str = Field(min_length=1, max_length=MAX_REF, description="Label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="In, NotIn, Exists or DoesNotExist.")
    values: list[str] | None = Field(default=None, max_length=MAX_ITEMS, description="Values (In, NotIn).")


class LabelSelector(_Strict):
    """A Kubernetes label selector."""

    match_labels: dict[str, str] | None = Field(default=None, max_length=MAX_ITEMS, description="Labels to match.")
    match_expressions: list[LabelSelectorRequirement] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Requirements (ANDed)."))


class PodAffinityTerm(_Strict):
    """Pods (selected by labels) this pod should be co-located with, or kept apart from, per topology domain."""

    label_selector: LabelSelector | None = Field(default=None, description="Pods this term applies to.")
    namespaces: list[str] | None = Field(default=None, max_length=MAX_ITEMS, description="Namespaces to look in.")
    namespace_selector: LabelSelector | None = Field(default=None, description="Namespaces to look in, by label.")
    topology_key: str = Field(min_length=1, max_length=MAX_REF, description=(
        "Node label that defines the domain (e.g. kubernetes.io/hostname)."))
    match_label_keys: list[str] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Label keys whose values are taken from this pod."))
    mismatch_label_keys: list[str] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Label keys whose values must differ from this pod's."))


class WeightedPodAffinityTerm(_Strict):
    """A weighted pod (anti-)affinity preference."""

    weight: int = Field(ge=1, le=100, description="Weight 1-100.")
    pod_affinity_term: PodAffinityTerm = Field(description="The term.")


class PodAffinity(_Strict):
    """Pod affinity or anti-affinity."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = Field(
        default=None, max_length=MAX_ITEMS, description="Terms that must hold.")
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = Field(
        default=None, max_length=MAX_ITEMS, description="Terms preferred, by weight.")


class Affinity(_Strict):
    """Kubernetes affinity (node, pod, pod anti-affinity), as in a Pod spec."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Node affinity.")
    pod_affinity: PodAffinity | None = Field(default=None, description="Pod affinity.")
    pod_anti_affinity: PodAffinity | None = Field(default=None, description="Pod anti-affinity.")


class TopologySpreadConstraint(_Strict):
    """Spread the job's pods over topology domains (zones, nodes, racks)."""

    max_skew: int = Field(ge=1, description="Largest allowed difference of matching pods between domains.")
    topology_key: str = Field(min_length=1, max_length=MAX_REF, description="Node label that defines the domain.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(description=(
        "DoNotSchedule or ScheduleAnyway."))
    label_selector: LabelSelector | None = Field(default=None, description="Pods counted.")
    min_domains: int | None = Field(default=None, ge=1, description="Minimum number of eligible domains.")
    node_affinity_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description="Honor or Ignore.")
    node_taints_policy: Literal["Honor", "Ignore"] | None = Field(default=None, description="Honor or Ignore.")
    match_label_keys: list[str] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Label keys whose values are taken from this pod."))


# --------------------------------------------------------------------------------------------------------
# Environment


class SecretKeySelector(_Strict):
    """One key of a Secret."""

    name: str = _Name
    key: str = Field(min_length=1, max_length=MAX_NAME, description="Key in the Secret.")
    optional: bool | None = Field(default=None, description="The variable is left unset when the key is missing.")


class ConfigMapKeySelector(_Strict):
    """One key of a ConfigMap."""

    name: str = _Name
    key: str = Field(min_length=1, max_length=MAX_NAME, description="Key in the ConfigMap.")
    optional: bool | None = Field(default=None, description="The variable is left unset when the key is missing.")


class ObjectFieldSelector(_Strict):
    """A field of the pod (e.g. metadata.name, status.podIP, spec.nodeName)."""

    field_path: str = Field(min_length=1, max_length=MAX_REF, description="Field path, e.g. status.podIP.")
    api_version: str | None = Field(default=None, max_length=MAX_REF, description="Schema version (default v1).")


class ResourceFieldSelector(_Strict):
    """A resource request or limit of the container (e.g. limits.memory)."""

    container_name: str | None = Field(default=None, max_length=MAX_REF, description="Container (default: this one).")
    resource: str = Field(min_length=1, max_length=MAX_REF, description="e.g. limits.cpu, requests.memory.")
    divisor: Quantity | None = Field(default=None, description="Unit of the exposed value (default 1).")


class EnvVarSource(_Strict):
    """Where a variable's value comes from (exactly one source)."""

    model_config = ConfigDict(json_schema_extra=_cel(_one_of(
        ("secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef"), "valueFrom")))

    secret_key_ref: SecretKeySelector | None = Field(default=None, description="A key of a Secret (e.g. HF_TOKEN).")
    config_map_key_ref: ConfigMapKeySelector | None = Field(default=None, description="A key of a ConfigMap.")
    field_ref: ObjectFieldSelector | None = Field(default=None, description="A field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(default=None, description="A resource of the container.")

    @model_validator(mode="after")
    def _check(self) -> EnvVarSource:
        if _count_set(self, ("secret_key_ref", "config_map_key_ref", "field_ref", "resource_field_ref")) != 1:
            _raise([("", "exactly one of secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef must be set")])
        return self


class EnvVar(_Strict):
    """An environment variable: a literal `value` or a `valueFrom` source (never a secret in the CR itself)."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("!self.name.startsWith('SPECRL_')", "SPECRL_* variables are set by the operator", ".name"),
        ("!has(self.value) || !has(self.valueFrom)", "value and valueFrom are mutually exclusive", ".valueFrom"),
    ))

    name: str = Field(pattern=ENV_NAME.pattern, min_length=1, max_length=MAX_REF, description="Variable name.")
    value: str | None = Field(default=None, max_length=MAX_VALUE, description="Literal value.")
    value_from: EnvVarSource | None = Field(default=None, description=(
        "Value from a Secret or ConfigMap key, or a field of the pod."))

    @model_validator(mode="after")
    def _check(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            _raise([("valueFrom", "value and valueFrom are mutually exclusive")])
        return self


class ConfigMapEnvSource(_Strict):
    """Every key of a ConfigMap as a variable."""

    name: str = _Name
    optional: bool | None = Field(default=None, description="Start the pod even if the ConfigMap is missing.")


class SecretEnvSource(_Strict):
    """Every key of a Secret as a variable."""

    name: str = _Name
    optional: bool | None = Field(default=None, description="Start the pod even if the Secret is missing.")


class EnvFromSource(_Strict):
    """Every key of a ConfigMap or a Secret as environment variables (exactly one source)."""

    model_config = ConfigDict(json_schema_extra=_cel(_one_of(("configMapRef", "secretRef"), "envFrom")))

    prefix: str | None = Field(default=None, max_length=MAX_REF, description="Prefix added to every variable name.")
    config_map_ref: ConfigMapEnvSource | None = Field(default=None, description="The ConfigMap.")
    secret_ref: SecretEnvSource | None = Field(default=None, description="The Secret.")

    @model_validator(mode="after")
    def _check(self) -> EnvFromSource:
        if _count_set(self, ("config_map_ref", "secret_ref")) != 1:
            _raise([("", "exactly one of configMapRef, secretRef must be set")])
        return self


# --------------------------------------------------------------------------------------------------------
# Volumes


class KeyToPath(_Strict):
    """Project one key of a ConfigMap or Secret to a file."""

    key: str = Field(min_length=1, max_length=MAX_NAME, description="Key.")
    path: str = Field(min_length=1, max_length=MAX_PATH, description="Relative file path.")
    mode: int | None = Field(default=None, ge=0, le=0o777, description="File mode bits (decimal).")


class PersistentVolumeClaimVolumeSource(_Strict):
    """A PersistentVolumeClaim in the job's namespace (data, checkpoints, model cache)."""

    claim_name: str = Field(min_length=1, max_length=MAX_NAME, description="Name of the PVC.")
    read_only: bool | None = Field(default=None, description="Mount read-only.")


class EmptyDirVolumeSource(_Strict):
    """A scratch directory that lives as long as the pod."""

    medium: Literal["", "Memory"] | None = Field(default=None, description='"" (node disk) or Memory (tmpfs).')
    size_limit: Quantity | None = Field(default=None, description="Size limit, e.g. 10Gi.")


class ConfigMapVolumeSource(_Strict):
    """A ConfigMap's keys as files."""

    name: str = _Name
    items: list[KeyToPath] | None = Field(default=None, max_length=MAX_ITEMS, description="Keys to project (default all).")
    default_mode: int | None = Field(default=None, ge=0, le=0o777, description="File mode bits (decimal).")
    optional: bool | None = Field(default=None, description="Start the pod even if the ConfigMap is missing.")


class SecretVolumeSource(_Strict):
    """A Secret's keys as files."""

    secret_name: str = Field(min_length=1, max_length=MAX_NAME, description="Name of the Secret.")
    items: list[KeyToPath] | None = Field(default=None, max_length=MAX_ITEMS, description="Keys to project (default all).")
    default_mode: int | None = Field(default=None, ge=0, le=0o777, description="File mode bits (decimal).")
    optional: bool | None = Field(default=None, description="Start the pod even if the Secret is missing.")


class LocalObjectReference(_Strict):
    """A named object in the same namespace."""

    name: str = _Name


class CSIVolumeSource(_Strict):
    """An inline CSI volume (e.g. a Secrets Store, a parallel filesystem driver)."""

    driver: str = Field(min_length=1, max_length=MAX_REF, description="CSI driver name.")
    read_only: bool | None = Field(default=None, description="Mount read-only.")
    fs_type: str | None = Field(default=None, max_length=MAX_REF, description="Filesystem type.")
    volume_attributes: dict[str, str] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Driver-specific attributes."))
    node_publish_secret_ref: LocalObjectReference | None = Field(default=None, description=(
        "Secret passed to the driver."))


class HostPathVolumeSource(_Strict):
    """A directory of the node (refused unless the template sets allowHostPath)."""

    path: str = Field(min_length=1, max_length=MAX_PATH, description="Path on the node.")
    type: Literal["", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice",
                  "BlockDevice"] | None = Field(default=None, description="Expected type of the path.")


_VOLUME_SOURCES = ("persistentVolumeClaim", "emptyDir", "configMap", "secret", "csi", "hostPath")


class Volume(_Strict):
    """A pod volume: exactly one source."""

    model_config = ConfigDict(json_schema_extra=_cel(_one_of(_VOLUME_SOURCES, "volume source")))

    name: str = Field(min_length=1, max_length=63, pattern=DNS1123_LABEL.pattern, description=(
        "Volume name (DNS-1123 label), referred to by volumeMounts."))
    persistent_volume_claim: PersistentVolumeClaimVolumeSource | None = Field(default=None, description="A PVC.")
    empty_dir: EmptyDirVolumeSource | None = Field(default=None, description="Pod-lifetime scratch space.")
    config_map: ConfigMapVolumeSource | None = Field(default=None, description="A ConfigMap as files.")
    secret: SecretVolumeSource | None = Field(default=None, description="A Secret as files.")
    csi: CSIVolumeSource | None = Field(default=None, description="An inline CSI volume.")
    host_path: HostPathVolumeSource | None = Field(default=None, description=(
        "A node directory: refused unless allowHostPath is true (breaks the restricted Pod Security Standard)."))

    @model_validator(mode="after")
    def _check(self) -> Volume:
        if _count_set(self, ("persistent_volume_claim", "empty_dir", "config_map", "secret", "csi", "host_path")) != 1:
            _raise([("", f"exactly one of {', '.join(_VOLUME_SOURCES)} must be set")])
        return self


class VolumeMount(_Strict):
    """Where a volume appears in the container."""

    name: str = Field(min_length=1, max_length=63, description="A volume of the same (merged) template.")
    mount_path: str = Field(min_length=2, max_length=MAX_PATH, pattern=r"^/", description="Absolute path.")
    sub_path: str | None = Field(default=None, max_length=MAX_PATH, description="Sub-path of the volume.")
    read_only: bool | None = Field(default=None, description="Mount read-only.")


# --------------------------------------------------------------------------------------------------------
# The template


def _resource_names_cel(field: str) -> tuple[str, str, str]:
    standard = ", ".join(f"'{r}'" for r in STANDARD_RESOURCES)
    return ((f"!has(self.{field}) || self.{field}.all(k, k.matches('{QUALIFIED_NAME_CEL}') && "
             f"(k.contains('/') || k in [{standard}] || k.startsWith('hugepages-')))"),
            (f"resource names are {', '.join(STANDARD_RESOURCES)}, hugepages-<size> or a domain-prefixed extended "
             "resource such as example.com/fpga"), f".{field}")


class ResourceRequirements(_Strict):
    """Container resource requests and limits (quantities such as "4", "16Gi", "500m")."""

    model_config = ConfigDict(json_schema_extra=_cel(_resource_names_cel("requests"), _resource_names_cel("limits")))

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=MAX_ITEMS, description="Requests per resource name.")
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=MAX_ITEMS, description="Limits per resource name.")

    @model_validator(mode="after")
    def _check(self) -> ResourceRequirements:
        _raise([(f"{kind}.{name}", problem) for kind in ("requests", "limits") for name in getattr(self, kind)
                if (problem := resource_name_problem(name)) is not None])
        return self


# Fields a role override replaces whole vs. merges by key (see the module docstring).
REPLACED_FIELDS = ("node_selector", "tolerations", "affinity", "topology_spread_constraints", "resources",
                   "scheduler_name", "runtime_class_name", "priority_class_name", "service_account_name",
                   "image_pull_policy")
_MERGE_KEYS = {"env": "name", "volumes": "name", "volume_mounts": "mount_path", "image_pull_secrets": "name"}


class PodTemplate(_Strict):
    """Kubernetes pod fields for the job's pods: the common template, or one role's override of it.

    Unset fields (null) inherit; see `specrl.runtime.podspec` for how a role's override merges."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("!has(self.resources) || !has(self.resources.requests) || !('nvidia.com/gpu' in self.resources.requests)",
         "set spec.resources.gpusPerPod instead of nvidia.com/gpu", ".resources.requests"),
        ("!has(self.resources) || !has(self.resources.limits) || !('nvidia.com/gpu' in self.resources.limits)",
         "set spec.resources.gpusPerPod instead of nvidia.com/gpu", ".resources.limits"),
        (("!has(self.volumes) || (has(self.allowHostPath) && self.allowHostPath) || "
         "self.volumes.all(v, !has(v.hostPath))"),
         "hostPath volumes are refused unless allowHostPath is true", ".volumes"),
        ("!has(self.volumes) || self.volumes.all(v, !(v.name in ['config', 'cache', 'dshm']))",
         "volume names config, cache and dshm are the operator's", ".volumes"),
        (f"!has(self.volumeMounts) || self.volumeMounts.all(m, !({_overlaps_cel('m.mountPath', RESERVED_MOUNT_PATHS)}))",
         f"mountPaths must not overlap the operator's mounts ({', '.join(RESERVED_MOUNT_PATHS)})", ".volumeMounts"),
        _keys_cel("nodeSelector", "nodeSelector keys"),
        _keys_cel("labels", "label keys"),
        _keys_cel("annotations", "annotation keys", any_case=True),
    ))

    node_selector: dict[str, LabelValue] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Node selector (node label keys and values)."))
    tolerations: list[Toleration] | None = Field(default=None, max_length=MAX_ITEMS, description="Tolerations.")
    affinity: Affinity | None = Field(default=None, description="Node and pod (anti-)affinity.")
    topology_spread_constraints: list[TopologySpreadConstraint] | None = Field(
        default=None, max_length=MAX_ITEMS, description="Spread of the pods over zones or nodes.")
    scheduler_name: str | None = Field(default=None, min_length=1, max_length=MAX_REF, description=(
        "Scheduler of the pods, e.g. volcano (gang scheduling; Kueue works through labels)."))
    runtime_class_name: str | None = Field(default=None, min_length=1, max_length=MAX_REF, description=(
        "RuntimeClass of the pods, e.g. nvidia."))
    resources: ResourceRequirements | None = Field(default=None, description=(
        "Extra requests/limits (GPUs come from gpusPerPod; do not set nvidia.com/gpu here)."))
    env: list[EnvVar] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Environment variables (unique names; valueFrom for secrets)."),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    env_from: list[EnvFromSource] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Every key of a ConfigMap or Secret as variables."))
    volumes: list[Volume] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Volumes: persistentVolumeClaim, emptyDir, configMap, secret, csi (hostPath only with allowHostPath)."),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    volume_mounts: list[VolumeMount] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Mounts of those volumes into the container (a volume mounted at /var/cache/specrl holds the model "
        "cache, shared across pods and moves)."),
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["mountPath"]})
    image_pull_secrets: list[LocalObjectReference] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Secrets for pulling the image from a private registry."))
    labels: dict[str, LabelValue] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Extra pod labels (Kubernetes label keys; values at most 63 characters)."))
    annotations: dict[str, str] | None = Field(default=None, max_length=MAX_ITEMS, description=(
        "Extra pod annotations (qualified-name keys; all of them at most 256 KiB)."))
    service_account_name: str | None = Field(default=None, max_length=MAX_NAME, description="Service account of the pods.")
    priority_class_name: str | None = Field(default=None, max_length=MAX_NAME, description="Priority class of the pods.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(default=None, description=(
        "Image pull policy; null = the Kubernetes default."))
    allow_host_path: bool | None = Field(default=None, description=(
        "Allow hostPath volumes in this template (off: they break the restricted Pod Security Standard)."))

    @model_validator(mode="after")
    def _check(self) -> PodTemplate:
        problems = []
        for kind in ("requests", "limits"):
            if self.resources is not None and GPU_RESOURCE in getattr(self.resources, kind):
                problems.append((f"resources.{kind}.{GPU_RESOURCE}", "set spec.resources.gpusPerPod instead"))
        seen: set[str] = set()
        for i, var in enumerate(self.env or []):
            if var.name in seen:
                problems.append((f"env[{i}].name", f"duplicate variable {var.name!r}"))
            if var.name.startswith("SPECRL_"):
                problems.append((f"env[{i}].name", "SPECRL_* variables are set by the operator"))
            seen.add(var.name)
        names: set[str] = set()
        for i, vol in enumerate(self.volumes or []):
            if vol.name in names:
                problems.append((f"volumes[{i}].name", f"duplicate volume {vol.name!r}"))
            if vol.name in RESERVED_VOLUMES:
                problems.append((f"volumes[{i}].name", (f"{vol.name!r} is reserved for the operator's volumes "
                                 f"({', '.join(RESERVED_VOLUMES)})")))
            if vol.host_path is not None and not self.allow_host_path:
                problems.append((f"volumes[{i}].hostPath", ("hostPath volumes are refused unless allowHostPath is "
                                 "true (they break the restricted Pod Security Standard); use a "
                                 "persistentVolumeClaim")))
            names.add(vol.name)
        for field, keys in (("nodeSelector", self.node_selector), ("labels", self.labels),
                            ("annotations", self.annotations)):
            # The API server checks annotation keys lower-cased (Example.com/x is fine there), label keys as they are.
            problems += [(f"{field}.{key}", f"invalid key: {problem}") for key in keys or {}
                         if (problem := qualified_name_problem(key.lower() if field == "annotations" else key))]
        size = sum(len(k.encode()) + len(v.encode()) for k, v in (self.annotations or {}).items())
        if size > MAX_ANNOTATIONS_BYTES:
            problems.append(("annotations", f"{size} bytes in all; the API server allows {MAX_ANNOTATIONS_BYTES}"))
        paths: set[str] = set()
        for i, mount in enumerate(self.volume_mounts or []):
            path = mount.mount_path.rstrip("/") or "/"
            if path in paths:
                problems.append((f"volumeMounts[{i}].mountPath", f"duplicate mountPath {path!r}"))
            if any(path == p or path.startswith(p + "/") or p.startswith(path + "/") for p in RESERVED_MOUNT_PATHS):
                problems.append((f"volumeMounts[{i}].mountPath", (f"{path!r} overlaps the operator's mounts "
                                 f"({', '.join(RESERVED_MOUNT_PATHS)})")))
            paths.add(path)
        _raise(problems)
        return self


def merge_templates(common: PodTemplate, role: PodTemplate | None) -> PodTemplate:
    """`role`'s override over `common`: placement and sizing replaced whole, lists and maps merged by key."""
    if role is None:
        return common.model_copy(deep=True)
    out: dict[str, Any] = {}
    for name in PodTemplate.model_fields:
        base, over = getattr(common, name), getattr(role, name)
        if over is None:
            out[name] = base
        elif base is None or name in REPLACED_FIELDS:
            out[name] = over
        elif name in _MERGE_KEYS:
            key = _MERGE_KEYS[name]
            merged = {getattr(item, key): item for item in base}
            merged.update({getattr(item, key): item for item in over})
            out[name] = list(merged.values())
        elif name == "env_from":
            out[name] = [*base, *(item for item in over if item not in base)]
        elif name in ("labels", "annotations"):
            out[name] = {**base, **over}
        elif name == "allow_host_path":
            out[name] = over
        else:  # a new field must be classified above
            raise AssertionError(f"merge_templates: unclassified PodTemplate field {name}")
    return PodTemplate.model_construct(**{k: v for k, v in out.items() if v is not None},
                                       _fields_set={k for k, v in out.items() if v is not None}).model_copy(deep=True)


def mount_problems(mounts: list[VolumeMount] | None, volumes_by_role: dict[str, set[str]],
                   prefix: str) -> list[tuple[str, str]]:
    """Mounts that name no volume of a role they apply to (field paths relative to `prefix`)."""
    problems = []
    for i, mount in enumerate(mounts or []):
        for role, volumes in volumes_by_role.items():
            if mount.name not in volumes:
                problems.append((f"{prefix}volumeMounts[{i}].name", (f"no volume named {mount.name!r} in the "
                                 f"{role} pods (volumes: {', '.join(sorted(volumes)) or 'none'})")))
                break
    return problems
