"""Desired child objects of an RLJob, as plain manifests (pure: no I/O, no clock, no randomness).

One RLJob ``J`` in namespace ``N`` owns:

* ConfigMap ``J-config`` — ``job.yaml``, the resolved job (defaults filled in) that every pod reads;
* Secret ``J-token`` — ``token``, the bearer token for the coordinator's ``POST /drain``;
* Service ``J-workers`` — headless, selects every pod of the job, gives each pod a stable DNS name
  ``<pod>.J-workers.N.svc`` for Ray and torch.distributed rendezvous;
* Service ``J-coordinator`` — ports ``http`` 8000, ``ray`` 6379 (GCS) and ``metrics``;
* Pod ``J-coordinator-0`` and pods ``J-trainer-<i>``, ``J-rollout-<i>`` — single pods rather than a
  Deployment, so that one named worker can be drained and removed (as KubeRay does).

Every object carries an ownerReference to the RLJob (garbage collection on delete), the
``app.kubernetes.io/*`` labels and ``specrl.io/job`` / ``specrl.io/role``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

API_VERSION = "specrl.io/v1alpha1"
KIND = "RLJob"
CONFIG_MOUNT = "/etc/specrl"
CONFIG_FILE = f"{CONFIG_MOUNT}/job.yaml"
CACHE_MOUNT = "/var/cache/specrl"
HF_HOME = f"{CACHE_MOUNT}/huggingface"
HTTP_PORT = 8000
RAY_PORT = 6379
METRICS_PORT = 9090
SYNC_PORT = 29500
GPU_RESOURCE = "nvidia.com/gpu"
WORKER_ROLES = ("trainer", "rollout")
ALL_ROLES = ("coordinator", *WORKER_ROLES)

LABEL_JOB = "specrl.io/job"
LABEL_ROLE = "specrl.io/role"
LABEL_INDEX = "specrl.io/worker-index"
ANNOTATION_CONFIG_HASH = "specrl.io/config-hash"
MANAGED_BY = "specrl-operator"

# Restricted Pod Security Standard: every field the "restricted" profile checks.
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@dataclass(frozen=True)
class Owner:
    """The RLJob as an owner: enough to build ownerReferences and names."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        meta = body.get("metadata", {})
        return cls(name=str(meta["name"]), namespace=str(meta.get("namespace") or "default"), uid=str(meta.get("uid", "")))

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


# ---- names --------------------------------------------------------------------------------------

def pod_name(job: str, role: str, index: int) -> str:
    return f"{job}-{role}-{index}"


def config_map_name(job: str) -> str:
    return f"{job}-config"


def secret_name(job: str) -> str:
    return f"{job}-token"


def headless_service_name(job: str) -> str:
    return f"{job}-workers"


def coordinator_service_name(job: str) -> str:
    return f"{job}-coordinator"


def parse_pod_name(job: str, name: str) -> tuple[str, int] | None:
    """``(role, index)`` for a pod named ``{job}-{role}-{index}``, else None."""
    for role in ALL_ROLES:
        prefix = f"{job}-{role}-"
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            return role, int(name[len(prefix):])
    return None


def plan_indexes(replicas: int, existing: Iterable[int]) -> list[int]:
    """Indexes the role should have: keep the lowest existing ones, fill up with the smallest free ones.

    Keeping existing pods (never renumbering) is what makes convergence level-based and stable:
    the same observed pods and replica count always give the same plan, and a surplus is removed
    from the highest index down, matching the rebalancer's victim choice.
    """
    have = sorted(set(existing))
    keep = have[:replicas]
    taken = set(have)
    out = list(keep)
    i = 0
    while len(out) < replicas:
        if i not in taken:
            out.append(i)
            taken.add(i)
        i += 1
    return sorted(out)


def next_free_index(existing: Iterable[int]) -> int:
    taken = set(existing)
    i = 0
    while i in taken:
        i += 1
    return i


# ---- spec accessors ----------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """Pydantic models -> JSON-ready data with camelCase keys and no nulls."""
    if hasattr(value, "model_dump"):
        return value.model_dump(by_alias=True, mode="json", exclude_none=True)
    return value


# Set by `specrl operator --default-job-image` (Helm value `jobImage`): the image of jobs that name none.
DEFAULT_JOB_IMAGE_ENV = "SPECRL_DEFAULT_JOB_IMAGE"


def image_of(job: Any, role: str | None = None) -> str:
    """`role`'s own image, else the job's, else the operator's default job image, else the built-in one."""
    from ..runtime.api import DEFAULT_IMAGE

    res = job.spec.resources
    return str((role and res.role_image(role)) or res.image or os.environ.get(DEFAULT_JOB_IMAGE_ENV) or DEFAULT_IMAGE)


def role_images(job: Any) -> dict[str, str]:
    """The images the roles name themselves (the roles that name none use the job's image)."""
    return {role: str(img) for role in ("coordinator", *WORKER_ROLES)
            if (img := job.spec.resources.role_image(role)) is not None}


def gpus_per_pod(job: Any) -> int:
    return int(job.spec.resources.gpus_per_pod)


# ---- manifests ----------------------------------------------------------------------------------

def labels(owner: Owner, role: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    out = dict(extra or {})
    out |= {
        "app.kubernetes.io/name": "specrl",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/part-of": "specrl",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_JOB: owner.name,
    }
    if role is not None:
        out["app.kubernetes.io/component"] = role
        out[LABEL_ROLE] = role
    return out


def _meta(owner: Owner, name: str, role: str | None = None, job: Any = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        # The job's own labels travel to every child (cost allocation, team selectors), ours win.
        "labels": labels(owner, role, job.metadata.labels if job is not None else None),
        "ownerReferences": [owner.reference()],
    }


_rendered: dict[int, tuple[Any, str]] = {}


def config_text(job: Any, owner: Owner) -> str:
    """The job as every pod reads it (``job.yaml``): resolved defaults, server-set metadata dropped.

    Memoised per job object (the reconciler reuses one parsed object per spec version): rendering YAML
    is the most expensive step of a reconcile and its input does not change between timer ticks.
    """
    hit = _rendered.get(id(job))
    if hit is not None and hit[0] is job:
        return hit[1]
    text = str(job.config_yaml())
    if len(_rendered) > 4096:
        _rendered.clear()
    _rendered[id(job)] = (job, text)  # the reference keeps id() from being reused while cached
    return text


def config_hash(job: Any, owner: Owner) -> str:
    return hashlib.sha256(config_text(job, owner).encode()).hexdigest()[:16]


def config_map(job: Any, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(owner, config_map_name(owner.name), job=job),
        "data": {"job.yaml": config_text(job, owner)},
    }


def secret(owner: Owner, token: str, job: Any = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(owner, secret_name(owner.name), job=job),
        "stringData": {"token": token},
    }


def headless_service(owner: Owner, job: Any = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, headless_service_name(owner.name), job=job),
        "spec": {
            "clusterIP": "None",
            # Rendezvous must resolve peers before they pass readiness.
            "publishNotReadyAddresses": True,
            "selector": {LABEL_JOB: owner.name},
            "ports": [
                {"name": "sync", "port": SYNC_PORT, "targetPort": SYNC_PORT, "protocol": "TCP"},
            ],
        },
    }


def coordinator_service(owner: Owner, job: Any = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, coordinator_service_name(owner.name), "coordinator", job),
        "spec": {
            "selector": {LABEL_JOB: owner.name, LABEL_ROLE: "coordinator"},
            "ports": [
                {"name": "http", "port": HTTP_PORT, "targetPort": HTTP_PORT, "protocol": "TCP"},
                {"name": "ray", "port": RAY_PORT, "targetPort": RAY_PORT, "protocol": "TCP"},
                # The coordinator serves Prometheus text on its HTTP port (GET /metrics).
                {"name": "metrics", "port": METRICS_PORT, "targetPort": HTTP_PORT, "protocol": "TCP"},
            ],
        },
    }


def _env(owner: Owner, role: str, index: int) -> list[dict[str, Any]]:
    job, ns = owner.name, owner.namespace
    coord = f"{coordinator_service_name(job)}.{ns}.svc"
    sync_master = f"{pod_name(job, 'trainer', 0)}.{headless_service_name(job)}.{ns}.svc"
    return [
        {"name": "SPECRL_JOB", "value": job},
        {"name": "SPECRL_NAMESPACE", "value": ns},
        {"name": "SPECRL_ROLE", "value": role},
        {"name": "SPECRL_WORKER", "value": pod_name(job, role, index)},
        {"name": "SPECRL_WORKER_INDEX", "value": str(index)},
        {"name": "SPECRL_CONFIG", "value": CONFIG_FILE},
        {"name": "SPECRL_COORDINATOR_ADDR", "value": f"{coord}:{HTTP_PORT}"},
        {"name": "SPECRL_RAY_ADDRESS", "value": f"{coord}:{RAY_PORT}"},
        {
            "name": "SPECRL_COORDINATOR_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": secret_name(job), "key": "token"}},
        },
        {"name": "SPECRL_SYNC_MASTER_ADDR", "value": sync_master},
        {"name": "SPECRL_SYNC_MASTER_PORT", "value": str(SYNC_PORT)},
        {"name": "SPECRL_METRICS_PORT", "value": str(HTTP_PORT if role == "coordinator" else METRICS_PORT)},
        {"name": "SPECRL_CACHE_DIR", "value": CACHE_MOUNT},
    ]


def _pod_template(job: Any, role: str) -> dict[str, Any]:
    """The role's pod template (camelCase dict): its override merged over the common template."""
    return dict(_plain(job.spec.resources.pod_template_for(role)))


def _resources(template: Mapping[str, Any], role: str, gpus: int) -> dict[str, Any]:
    res = copy.deepcopy(dict(template.get("resources") or {}))
    requests = {str(k): str(v) for k, v in (res.get("requests") or {}).items()}
    limits = {str(k): str(v) for k, v in (res.get("limits") or {}).items()}
    # The GPU count is the budget the rebalancer accounts for: it comes from gpusPerPod only.
    requests.pop(GPU_RESOURCE, None)
    limits.pop(GPU_RESOURCE, None)
    if role in WORKER_ROLES and gpus > 0:
        requests[GPU_RESOURCE] = str(gpus)
        limits[GPU_RESOURCE] = str(gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def pod(job: Any, owner: Owner, role: str, index: int, config_digest: str | None = None) -> dict[str, Any]:
    name = pod_name(owner.name, role, index)
    template = _pod_template(job, role)
    env = _env(owner, role, index)
    reserved = {e["name"] for e in env}
    user_env = template.get("env") or []
    # Hub downloads land in the model cache too, so a pod moved to another role (or recreated) on a shared
    # cache volume does not fetch the model again; a user's HF_HOME wins.
    if not any(e.get("name") == "HF_HOME" for e in user_env):
        env.append({"name": "HF_HOME", "value": HF_HOME})
    # User env (literal values and valueFrom alike) may add variables but never override the contract.
    env += [copy.deepcopy(e) for e in user_env if e.get("name") not in reserved]
    meta = _meta(owner, name, role, job)
    meta["labels"] = {**(template.get("labels") or {}), **meta["labels"], LABEL_INDEX: str(index)}
    meta["annotations"] = {**(template.get("annotations") or {}), ANNOTATION_CONFIG_HASH: config_digest or config_hash(job, owner)}
    ports = [{"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}]
    if role == "coordinator":
        ports = [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "ray", "containerPort": RAY_PORT, "protocol": "TCP"},
        ]
    elif role == "trainer" and index == 0:
        ports.append({"name": "sync", "containerPort": SYNC_PORT, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": role,
        "image": image_of(job, role),
        "command": ["specrl", "worker", role, "--config", CONFIG_FILE],
        "env": env,
        "ports": ports,
        "resources": _resources(template, role, gpus_per_pod(job)),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY_CONTEXT),
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "cache", "mountPath": CACHE_MOUNT},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    user_mounts = [copy.deepcopy(m) for m in template.get("volumeMounts") or []]
    shared_cache = any(m["mountPath"].rstrip("/") == CACHE_MOUNT for m in user_mounts)
    if shared_cache:  # the user's volume (a PVC, typically) is the model cache: no emptyDir of our own
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "cache"]
    container["volumeMounts"] += user_mounts
    if template.get("envFrom"):
        container["envFrom"] = copy.deepcopy(template["envFrom"])
    if role == "coordinator":
        container["readinessProbe"] = {
            "httpGet": {"path": "/healthz", "port": HTTP_PORT},
            "periodSeconds": 5,
            "failureThreshold": 3,
        }
    spec: dict[str, Any] = {
        # The operator owns restarts (backoff, backoffLimit, drains); the kubelet must not hide failures.
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": headless_service_name(owner.name),
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": config_map_name(owner.name)}},
            {"name": "cache", "emptyDir": {}},
            # NCCL and torch.distributed need more shared memory than the container default.
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if shared_cache:
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "cache"]
    spec["volumes"] += copy.deepcopy(template.get("volumes") or [])
    if template.get("imagePullPolicy"):
        container["imagePullPolicy"] = template["imagePullPolicy"]
    if template.get("serviceAccountName"):
        spec["serviceAccountName"] = template["serviceAccountName"]
    if template.get("priorityClassName"):
        spec["priorityClassName"] = template["priorityClassName"]
    if template.get("nodeSelector"):
        spec["nodeSelector"] = dict(template["nodeSelector"])
    if template.get("tolerations"):
        spec["tolerations"] = [dict(t) for t in template["tolerations"]]
    # Kubernetes structures the spec passes through verbatim (validated by runtime/podspec.py).
    for key in ("affinity", "topologySpreadConstraints", "imagePullSecrets", "schedulerName", "runtimeClassName"):
        if template.get(key):
            spec[key] = copy.deepcopy(template[key])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


@dataclass(frozen=True)
class Desired:
    """Everything the job should own, keyed by (kind, name)."""

    static: dict[tuple[str, str], dict[str, Any]]
    pods: dict[str, dict[str, Any]]

    @property
    def count(self) -> int:
        return len(self.static) + len(self.pods)


def desired(
    job: Any,
    owner: Owner,
    allocation: Mapping[str, int],
    existing_pods: Iterable[str] = (),
    token: str = "",
    workers: bool = True,
) -> Desired:
    """The desired children for ``allocation`` (replicas per worker role), keeping existing pod names.

    ``workers=False`` (suspended, complete) keeps only the job-level objects and the coordinator.
    """
    text = config_text(job, owner)  # rendered once: every pod carries its digest
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    cm = config_map(job, owner)
    static = {
        ("ConfigMap", config_map_name(owner.name)): cm,
        ("Secret", secret_name(owner.name)): secret(owner, token, job),
        ("Service", headless_service_name(owner.name)): headless_service(owner, job),
        ("Service", coordinator_service_name(owner.name)): coordinator_service(owner, job),
    }
    by_role: dict[str, list[int]] = {r: [] for r in ALL_ROLES}
    for name in existing_pods:
        parsed = parse_pod_name(owner.name, name)
        if parsed:
            by_role[parsed[0]].append(parsed[1])
    pods: dict[str, dict[str, Any]] = {}
    replicas = {"coordinator": 1, **{r: int(allocation.get(r, 0)) for r in WORKER_ROLES}}
    for role in ALL_ROLES:
        if role != "coordinator" and not workers:
            continue
        for i in plan_indexes(replicas[role], by_role[role]):
            p = pod(job, owner, role, i, digest)
            pods[p["metadata"]["name"]] = p
    return Desired(static=static, pods=pods)


def fingerprint(obj: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
