"""Pure child builders: names, ownership, labels, GPUs, security, env contract, overrides, schema validity."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from specrl.operator import children
from specrl.runtime.api import RLJob, parse_job

BASE: dict[str, Any] = {
    "apiVersion": "specrl.io/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "demo", "namespace": "team-a", "labels": {"team": "reasoning"}},
    "spec": {
        "model": {"name": "Qwen/Qwen3-8B", "dtype": "bfloat16"},
        "resources": {
            "image": "ghcr.io/specrl/specrl:test",
            "gpusPerPod": 2,
            "totalGPUs": 12,
            "trainer": {"replicas": 2, "minReplicas": 1},
            "rollout": {"replicas": 3, "minReplicas": 1},
            "podTemplate": {
                "nodeSelector": {"gpu": "h100"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
                "env": [{"name": "HF_HOME", "value": "/cache/hf"}],
                "labels": {"cost-center": "42"},
                "priorityClassName": "training",
            },
        },
    },
}
OWNER = children.Owner(name="demo", namespace="team-a", uid="1234-uid")
CONTRACT_ENV = {"SPECRL_JOB", "SPECRL_NAMESPACE", "SPECRL_ROLE", "SPECRL_WORKER", "SPECRL_WORKER_INDEX",
                "SPECRL_CONFIG", "SPECRL_COORDINATOR_ADDR", "SPECRL_RAY_ADDRESS", "SPECRL_COORDINATOR_TOKEN",
                "SPECRL_SYNC_MASTER_ADDR", "SPECRL_SYNC_MASTER_PORT"}


def job(**spec_updates) -> RLJob:
    doc = copy.deepcopy(BASE)
    doc["spec"].update(spec_updates)
    return RLJob.model_validate(doc).resolved()


def all_objects(j: RLJob, alloc=None, existing=()):
    d = children.desired(j, OWNER, alloc or {"trainer": 2, "rollout": 3}, existing, token="s3cret")
    return d, [*d.static.values(), *d.pods.values()]


def test_desired_children_names_and_count():
    d, objs = all_objects(job())
    assert sorted(d.pods) == ["demo-coordinator-0", "demo-rollout-0", "demo-rollout-1", "demo-rollout-2",
                              "demo-trainer-0", "demo-trainer-1"]
    assert sorted(d.static) == [("ConfigMap", "demo-config"), ("Secret", "demo-token"),
                                ("Service", "demo-coordinator"), ("Service", "demo-workers")]
    assert d.count == len(objs) == 10


def test_every_child_is_owned_labelled_and_namespaced():
    _, objs = all_objects(job())
    for obj in objs:
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [{"apiVersion": "specrl.io/v1alpha1", "kind": "RLJob", "name": "demo",
                                            "uid": "1234-uid", "controller": True, "blockOwnerDeletion": True}]
        labels = meta["labels"]
        assert labels["specrl.io/job"] == "demo"
        assert labels["app.kubernetes.io/name"] == "specrl"
        assert labels["app.kubernetes.io/instance"] == "demo"
        assert labels["app.kubernetes.io/managed-by"] == "specrl-operator"
        assert labels["team"] == "reasoning"  # the job's own labels travel to its children


def test_pods_roles_gpus_and_commands():
    d, _ = all_objects(job())
    for name, pod in d.pods.items():
        parsed = children.parse_pod_name("demo", name)
        assert parsed is not None, name
        role, index = parsed
        labels = pod["metadata"]["labels"]
        assert labels["specrl.io/role"] == role == labels["app.kubernetes.io/component"]
        assert labels["specrl.io/worker-index"] == str(index)
        assert labels["cost-center"] == "42"
        (c,) = pod["spec"]["containers"]
        assert c["command"] == ["specrl", "worker", role, "--config", "/etc/specrl/job.yaml"]
        assert c["image"] == "ghcr.io/specrl/specrl:test"
        res = c["resources"]
        assert res["requests"]["cpu"] == "8" and res["requests"]["memory"] == "64Gi"
        assert res["limits"]["memory"] == "96Gi"
        if role == "coordinator":
            assert "nvidia.com/gpu" not in res["requests"] and "nvidia.com/gpu" not in res.get("limits", {})
        else:
            assert res["requests"]["nvidia.com/gpu"] == "2" and res["limits"]["nvidia.com/gpu"] == "2"
            assert isinstance(res["requests"]["nvidia.com/gpu"], str)
        spec = pod["spec"]
        assert spec["restartPolicy"] == "Never"
        assert spec["nodeSelector"] == {"gpu": "h100"}
        assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert spec["priorityClassName"] == "training"
        assert spec["hostname"] == name and spec["subdomain"] == "demo-workers"


def test_cpu_jobs_request_no_gpus():
    d, _ = all_objects(job(resources={"gpusPerPod": 0, "trainer": {"replicas": 1}, "rollout": {"replicas": 1}}),
                       {"trainer": 1, "rollout": 1})
    for pod in d.pods.values():
        res = pod["spec"]["containers"][0]["resources"]
        assert "nvidia.com/gpu" not in res.get("requests", {}) and "nvidia.com/gpu" not in res.get("limits", {})


def test_restricted_pod_security():
    d, _ = all_objects(job())
    for pod in d.pods.values():
        psc = pod["spec"]["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["seccompProfile"] == {"type": "RuntimeDefault"}
        csc = pod["spec"]["containers"][0]["securityContext"]
        assert csc["allowPrivilegeEscalation"] is False
        assert csc["capabilities"] == {"drop": ["ALL"]}
        assert csc["runAsNonRoot"] is True and csc["privileged"] is False
        assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["spec"]["automountServiceAccountToken"] is False
        for vol in pod["spec"]["volumes"]:
            assert "hostPath" not in vol


def test_env_contract():
    d, _ = all_objects(job())
    pod = d.pods["demo-rollout-2"]
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert CONTRACT_ENV <= set(env)
    assert env["SPECRL_JOB"]["value"] == "demo" and env["SPECRL_NAMESPACE"]["value"] == "team-a"
    assert env["SPECRL_ROLE"]["value"] == "rollout" and env["SPECRL_WORKER"]["value"] == "demo-rollout-2"
    assert env["SPECRL_WORKER_INDEX"]["value"] == "2"
    assert env["SPECRL_CONFIG"]["value"] == "/etc/specrl/job.yaml"
    assert env["SPECRL_COORDINATOR_ADDR"]["value"] == "demo-coordinator.team-a.svc:8000"
    assert env["SPECRL_RAY_ADDRESS"]["value"] == "demo-coordinator.team-a.svc:6379"
    assert env["SPECRL_COORDINATOR_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "demo-token", "key": "token"}}
    assert env["SPECRL_SYNC_MASTER_ADDR"]["value"] == "demo-trainer-0.demo-workers.team-a.svc"
    assert env["SPECRL_SYNC_MASTER_PORT"]["value"] == "29500"
    assert env["HF_HOME"]["value"] == "/cache/hf"
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert len(names) == len(set(names))


def test_config_map_holds_the_resolved_job_that_pods_can_parse():
    d, _ = all_objects(job())
    cm = d.static[("ConfigMap", "demo-config")]
    parsed = parse_job(yaml.safe_load(cm["data"]["job.yaml"]))
    assert parsed.spec.resources.total_gpus == 12
    assert parsed.spec.model.name == "Qwen/Qwen3-8B"
    assert parsed.metadata.uid is None  # server-set metadata stays out of the pods' config
    mounts = d.pods["demo-trainer-0"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": "demo-config"}} in mounts


def test_secret_and_services():
    d, _ = all_objects(job())
    sec = d.static[("Secret", "demo-token")]
    assert sec["stringData"] == {"token": "s3cret"} and sec["type"] == "Opaque"
    headless = d.static[("Service", "demo-workers")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert headless["selector"] == {"specrl.io/job": "demo"}
    coord = d.static[("Service", "demo-coordinator")]["spec"]
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in coord["ports"]}
    assert ports["http"] == (8000, 8000) and ports["ray"] == (6379, 6379) and "metrics" in ports
    assert coord["selector"] == {"specrl.io/job": "demo", "specrl.io/role": "coordinator"}


def test_built_in_kinds_pass_the_kubernetes_schema():
    _, objs = all_objects(job())
    for obj in objs:
        kubernetes_validate.validate(obj, "1.33.0", strict=True)


def test_existing_pods_are_kept_and_gaps_filled():
    d, _ = all_objects(job(), {"trainer": 2, "rollout": 3}, existing=["demo-rollout-5", "demo-trainer-1"])
    assert sorted(n for n in d.pods if "rollout" in n) == ["demo-rollout-0", "demo-rollout-1", "demo-rollout-5"]
    assert sorted(n for n in d.pods if "trainer" in n) == ["demo-trainer-0", "demo-trainer-1"]
    # Surplus is dropped from the highest index down.
    d, _ = all_objects(job(), {"trainer": 1, "rollout": 1}, existing=["demo-rollout-0", "demo-rollout-4"])
    assert sorted(n for n in d.pods if "rollout" in n) == ["demo-rollout-0"]


def test_suspended_keeps_only_coordinator_and_job_objects():
    d = children.desired(job(), OWNER, {"trainer": 2, "rollout": 3}, (), workers=False)
    assert list(d.pods) == ["demo-coordinator-0"] and len(d.static) == 4


@pytest.mark.parametrize("name,expected", [
    ("demo-rollout-3", ("rollout", 3)), ("demo-coordinator-0", ("coordinator", 0)),
    ("demo-trainer-x", None), ("other-rollout-1", None), ("demo-rollout-", None),
])
def test_parse_pod_name(name, expected):
    assert children.parse_pod_name("demo", name) == expected


@given(st.integers(0, 20), st.sets(st.integers(0, 40), max_size=20))
def test_property_plan_indexes(replicas, existing):
    plan = children.plan_indexes(replicas, existing)
    assert len(plan) == replicas == len(set(plan))
    kept = set(plan) & existing
    assert kept == set(sorted(existing)[:replicas])  # the lowest existing survive, never renumbered
    assert children.plan_indexes(replicas, plan) == plan  # stable: converged input plans itself


def test_next_free_index():
    assert children.next_free_index([0, 1, 3]) == 2 and children.next_free_index([]) == 0


# ---- pods a real job can use: volumes, secrets in env, scheduling, per-role overrides --------------------

REAL: dict[str, Any] = {
    "podTemplate": {
        "nodeSelector": {"nvidia.com/gpu.product": "H100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"requests": {"cpu": "8", "memory": "96Gi"}},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}]}]}},
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 50, "podAffinityTerm": {
                "labelSelector": {"matchLabels": {"specrl.io/job": "demo"}}, "topologyKey": "kubernetes.io/hostname"}}]}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"specrl.io/job": "demo"}}}],
        "schedulerName": "volcano",
        "runtimeClassName": "nvidia",
        "imagePullSecrets": [{"name": "registry"}],
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}}],
        "envFrom": [{"secretRef": {"name": "wandb"}}, {"prefix": "APP_", "configMapRef": {"name": "settings"}}],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "math-data", "readOnly": True}},
                    {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}},
                    {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}},
                    {"name": "scratch", "emptyDir": {"sizeLimit": "50Gi"}},
                    {"name": "extra", "configMap": {"name": "settings", "items": [{"key": "a", "path": "a.txt"}]}},
                    {"name": "creds", "secret": {"secretName": "creds", "defaultMode": 256}},
                    {"name": "lustre", "csi": {"driver": "fsx.csi.aws.com", "volumeAttributes": {"x": "y"}}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True},
                         {"name": "checkpoints", "mountPath": "/checkpoints"},
                         {"name": "model-cache", "mountPath": "/var/cache/specrl"},
                         {"name": "scratch", "mountPath": "/scratch"}],
    },
    # The CPU-only coordinator: no GPU-node placement, small requests, no scratch disk.
    "coordinator": {"podTemplate": {"nodeSelector": {}, "tolerations": [], "affinity": {},
                                    "resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}},
    "trainer": {"replicas": 2, "minReplicas": 1, "podTemplate": {
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
        "volumes": [{"name": "scratch", "emptyDir": {"medium": "Memory"}}]}},
    "rollout": {"replicas": 3, "minReplicas": 1, "podTemplate": {"schedulerName": "default-scheduler"}},
}


def real_job() -> RLJob:
    doc = copy.deepcopy(BASE)
    doc["spec"]["resources"] = {**doc["spec"]["resources"], **copy.deepcopy(REAL)}
    return parse_job(doc).resolved()


def _container(pod):
    return pod["spec"]["containers"][0]


def test_pass_through_fields_reach_every_pod_verbatim():
    d, objs = all_objects(real_job())
    tpl = REAL["podTemplate"]
    for name in ("demo-trainer-0", "demo-rollout-1"):
        spec = d.pods[name]["spec"]
        assert spec["affinity"] == tpl["affinity"] and spec["topologySpreadConstraints"] == tpl["topologySpreadConstraints"]
        assert spec["runtimeClassName"] == "nvidia" and spec["imagePullSecrets"] == [{"name": "registry"}]
        assert spec["nodeSelector"] == tpl["nodeSelector"] and spec["tolerations"] == tpl["tolerations"]
        env = {e["name"]: e for e in _container(d.pods[name])["env"]}
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
        assert env["NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert env["MODE"]["valueFrom"] == {"configMapKeyRef": {"name": "settings", "key": "mode"}}
        assert "value" not in env["HF_TOKEN"]  # the secret never sits in the pod spec (or the CR)
        assert _container(d.pods[name])["envFrom"] == tpl["envFrom"]
    assert d.pods["demo-trainer-0"]["spec"]["schedulerName"] == "volcano"
    assert d.pods["demo-rollout-0"]["spec"]["schedulerName"] == "default-scheduler"  # the role's override wins
    for obj in objs:  # still valid Kubernetes objects, field for field
        kubernetes_validate.validate(obj, "1.33.0", strict=True)


def test_volumes_and_mounts_with_the_model_cache_on_a_shared_volume():
    d, _ = all_objects(real_job())
    pod = d.pods["demo-rollout-0"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in _container(pod)["volumeMounts"]}
    assert volumes["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "math-data", "readOnly": True}}
    assert volumes["lustre"]["csi"]["driver"] == "fsx.csi.aws.com"
    assert volumes["creds"]["secret"] == {"secretName": "creds", "defaultMode": 256}
    # The user's PVC at the cache path replaces the operator's emptyDir: a moved or recreated pod finds the model.
    assert mounts["/var/cache/specrl"] == "model-cache" and "cache" not in volumes
    assert mounts["/etc/specrl"] == "config" and mounts["/dev/shm"] == "dshm"
    assert mounts["/data"] == "data" and mounts["/checkpoints"] == "checkpoints"
    env = {e["name"]: e.get("value") for e in _container(pod)["env"]}
    assert env["HF_HOME"] == "/var/cache/specrl/huggingface" and env["SPECRL_CACHE_DIR"] == "/var/cache/specrl"
    # Without a cache volume the operator keeps its own emptyDir there.
    plain = all_objects(job())[0].pods["demo-rollout-0"]
    assert {"name": "cache", "emptyDir": {}} in plain["spec"]["volumes"]


def test_role_overrides_replace_placement_and_merge_lists():
    d, _ = all_objects(real_job())
    coord, trainer, rollout = d.pods["demo-coordinator-0"], d.pods["demo-trainer-0"], d.pods["demo-rollout-0"]
    # The coordinator does not inherit GPU-node placement or the 96Gi request.
    assert "nodeSelector" not in coord["spec"] and "tolerations" not in coord["spec"] and "affinity" not in coord["spec"]
    assert _container(coord)["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"}}
    assert _container(trainer)["resources"]["requests"] == {"cpu": "8", "memory": "96Gi", "nvidia.com/gpu": "2"}
    # ...but keeps the common volumes, mounts and secrets it needs (checkpoints, cache, HF token).
    assert {m["mountPath"] for m in _container(coord)["volumeMounts"]} >= {"/checkpoints", "/var/cache/specrl"}
    assert "HF_TOKEN" in {e["name"] for e in _container(coord)["env"]}
    # Lists merge by key, the role's entry winning: the trainer's scratch is tmpfs, the rollout's a disk.
    t_vols = {v["name"]: v for v in trainer["spec"]["volumes"]}
    r_vols = {v["name"]: v for v in rollout["spec"]["volumes"]}
    assert t_vols["scratch"] == {"name": "scratch", "emptyDir": {"medium": "Memory"}}
    assert r_vols["scratch"] == {"name": "scratch", "emptyDir": {"sizeLimit": "50Gi"}}
    t_env = {e["name"] for e in _container(trainer)["env"]}
    assert {"NCCL_DEBUG", "HF_TOKEN"} <= t_env and "NCCL_DEBUG" not in {e["name"] for e in _container(rollout)["env"]}


def test_restricted_pod_security_holds_with_user_volumes():
    d, _ = all_objects(real_job())
    for pod in d.pods.values():
        assert pod["spec"]["securityContext"] == children.POD_SECURITY_CONTEXT
        assert _container(pod)["securityContext"] == children.CONTAINER_SECURITY_CONTEXT
        assert all("hostPath" not in v for v in pod["spec"]["volumes"])
        assert "hostNetwork" not in pod["spec"] and "hostPID" not in pod["spec"]


def test_host_path_only_when_allowed():
    doc = copy.deepcopy(BASE)
    doc["spec"]["resources"]["podTemplate"] = {"volumes": [{"name": "node", "hostPath": {"path": "/mnt/nvme"}}],
                                              "volumeMounts": [{"name": "node", "mountPath": "/scratch"}]}
    with pytest.raises(Exception, match=r"spec\.resources\.podTemplate\.volumes\[0\]\.hostPath: hostPath volumes"):
        parse_job(copy.deepcopy(doc))
    doc["spec"]["resources"]["podTemplate"]["allowHostPath"] = True
    d, _ = all_objects(parse_job(doc).resolved())
    assert {"name": "node", "hostPath": {"path": "/mnt/nvme"}} in d.pods["demo-trainer-0"]["spec"]["volumes"]


@pytest.mark.parametrize("example", ["qwen3-8b-eagle3.yaml", "async-quantized-self.yaml"])
def test_cluster_examples_make_valid_pods_with_storage_and_a_cpu_coordinator(example):
    from pathlib import Path

    from specrl.runtime.api import load_job

    j = load_job(Path(__file__).resolve().parents[3] / "examples" / example).resolved()
    owner = children.Owner(name=j.metadata.name, namespace="ml", uid="0000")
    d = children.desired(j, owner, {"trainer": 1, "rollout": 1}, token="t")
    for pod in d.pods.values():
        kubernetes_validate.validate(pod, "1.33.0", strict=True)
        mounts = {m["mountPath"] for m in _container(pod)["volumeMounts"]}
        assert {"/checkpoints", "/var/cache/specrl"} <= mounts  # checkpoints and the model cache on PVCs
        assert (j.spec.checkpoint.path or "").startswith("/checkpoints/")
        env = {e["name"]: e for e in _container(pod)["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
    coord = d.pods[f"{j.metadata.name}-coordinator-0"]
    assert not coord["spec"].get("nodeSelector") and not coord["spec"].get("tolerations")
    requests = _container(coord)["resources"]["requests"]
    assert "nvidia.com/gpu" not in requests and int(requests["cpu"]) <= 2


def test_every_pod_template_field_has_a_merge_rule():
    from specrl.runtime.podspec import REPLACED_FIELDS, PodTemplate, merge_templates

    common = PodTemplate.model_validate(REAL["podTemplate"] | {"labels": {"a": "1"}, "annotations": {"a": "1"},
                                                               "serviceAccountName": "sa", "priorityClassName": "p",
                                                               "imagePullPolicy": "Always", "allowHostPath": False})
    role = PodTemplate.model_validate({"nodeSelector": {}, "labels": {"b": "2"}, "env": [{"name": "X", "value": "1"}],
                                       "serviceAccountName": "coord", "imagePullSecrets": [{"name": "other"}]})
    merged = merge_templates(common, role)  # raises for a field without a rule
    assert merged.node_selector == {} and merged.service_account_name == "coord"  # replaced whole
    assert merged.labels == {"a": "1", "b": "2"}  # merged by key
    assert merged.image_pull_secrets is not None and merged.env is not None and common.env is not None
    assert [s.name for s in merged.image_pull_secrets] == ["registry", "other"]
    assert [e.name for e in merged.env][-1] == "X" and len(merged.env) == len(common.env) + 1
    assert merged.tolerations == common.tolerations and merged.priority_class_name == "p"  # inherited
    assert merge_templates(common, None) == common
    assert set(REPLACED_FIELDS) < set(PodTemplate.model_fields)
