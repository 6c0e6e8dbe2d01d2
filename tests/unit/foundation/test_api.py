"""Every RLJob validation rule: a bad example, the exact field path, and the same verdict from the CRD.

Each case is checked twice: by the pydantic models (`parse_job`, what `specrl validate`, local mode and the
operator use) and by the generated CRD as the API server would apply it (openAPIV3Schema + CEL rules,
`tests.kube.schema`). `crd=None` marks the few rules the CRD cannot express.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from specrl.runtime import api
from specrl.runtime.api import API_VERSION, JobValidationError, RLJob, parse_job
from specrl.runtime.crd import build_crd

from tests.kube.schema import AdmissionError, CRDSchema

SAME = object()  # the CRD reports the same path as pydantic


def _doc(spec: dict[str, Any] | None = None, **top: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "RLJob", "metadata": {"name": "job"}, "spec": spec or {}}
    doc.update(top)
    return doc


def _pt(template: dict[str, Any]) -> dict[str, Any]:
    return _doc({"resources": {"podTemplate": template}})


def _mount_at(path: str) -> dict[str, Any]:
    """A job whose pods mount one emptyDir volume at `path`."""
    return _pt({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": path}]})


# (id, document, expected pydantic path, message fragment, CRD path: SAME | str | None)
CASES: list[tuple[str, dict[str, Any], str, str, Any]] = [
    # --- metadata and identity
    ("name-dns", _doc(metadata={"name": "Bad_Name"}), "metadata.name", "not a valid job name", SAME),
    ("name-leading-digit", _doc(metadata={"name": "1job"}), "metadata.name", "starting with a letter", SAME),
    ("name-too-long", _doc(metadata={"name": "a" * 46}), "metadata.name", "at most 45", SAME),
    ("name-missing", _doc(metadata={}), "metadata.name", "required field is missing", None),
    ("namespace-dns", _doc(metadata={"name": "job", "namespace": "Bad"}), "metadata.namespace",
     "not a DNS-1123 label", None),
    ("metadata-unknown", _doc(metadata={"name": "job", "lables": {}}), "metadata.lables", "unknown field", None),
    # --- unknown fields and types
    ("unknown-top", _doc(spce={}), "spce", "unknown field", "spce"),
    ("unknown-spec", _doc({"bogus": 1}), "spec.bogus", "unknown field", SAME),
    ("unknown-nested", _doc({"speculative": {"adaptve": {}}}), "spec.speculative.adaptve", "unknown field", SAME),
    ("type-int-as-string", _doc({"algorithm": {"steps": "20"}}), "spec.algorithm.steps", "valid integer", SAME),
    ("type-bool-as-string", _doc({"suspend": "yes"}), "spec.suspend", "valid boolean", SAME),
    ("type-object-as-list", _doc({"model": []}), "spec.model", "", SAME),
    ("type-float-as-string", _doc({"algorithm": {"learningRate": "fast"}}), "spec.algorithm.learningRate",
     "valid number", SAME),
    # --- enums
    ("dtype", _doc({"model": {"dtype": "int4"}}), "spec.model.dtype", "must be one of", SAME),
    ("algorithm-name", _doc({"algorithm": {"name": "ppo"}}), "spec.algorithm.name", "grpo", SAME),
    ("dataset-type", _doc({"dataset": {"type": "csv"}}), "spec.dataset.type", "must be one of", SAME),
    ("reward-type", _doc({"reward": {"type": "llm_judge"}}), "spec.reward.type", "must be one of", SAME),
    ("mode", _doc({"mode": "fast"}), "spec.mode", "must be one of", SAME),
    ("method", _doc({"speculative": {"method": "medusa"}}), "spec.speculative.method", "must be one of", SAME),
    ("backend", _doc({"weightSync": {"backend": "mpi"}}), "spec.weightSync.backend", "must be one of", SAME),
    ("toleration-op", _doc({"resources": {"podTemplate": {"tolerations": [{"operator": "In"}]}}}),
     "spec.resources.podTemplate.tolerations[0].operator", "must be one of", SAME),
    ("toleration-effect", _doc({"resources": {"podTemplate": {"tolerations": [{"effect": "Never"}]}}}),
     "spec.resources.podTemplate.tolerations[0].effect", "must be one of", SAME),
    ("pull-policy", _doc({"resources": {"podTemplate": {"imagePullPolicy": "Sometimes"}}}),
     "spec.resources.podTemplate.imagePullPolicy", "must be one of", SAME),
    # --- ranges
    ("group-size", _doc({"algorithm": {"groupSize": 1}}), "spec.algorithm.groupSize", ">= 2", SAME),
    ("lr-zero", _doc({"algorithm": {"learningRate": 0}}), "spec.algorithm.learningRate", "greater than 0", SAME),
    ("lr-big", _doc({"algorithm": {"learningRate": 2.0}}), "spec.algorithm.learningRate", "less than or equal", SAME),
    ("clip", _doc({"algorithm": {"clipRatio": 1.0}}), "spec.algorithm.clipRatio", "less than 1", SAME),
    ("kl", _doc({"algorithm": {"klCoef": -0.1}}), "spec.algorithm.klCoef", "greater than or equal to 0", SAME),
    ("steps", _doc({"algorithm": {"steps": 0}}), "spec.algorithm.steps", "greater than or equal to 1", SAME),
    ("prompts", _doc({"algorithm": {"promptsPerStep": 0}}), "spec.algorithm.promptsPerStep", ">= 1", SAME),
    ("max-new", _doc({"algorithm": {"maxNewTokens": 0}}), "spec.algorithm.maxNewTokens", ">= 1", SAME),
    ("temperature", _doc({"algorithm": {"temperature": 0.0}}), "spec.algorithm.temperature", "greater than 0", SAME),
    ("top-p", _doc({"algorithm": {"topP": 1.5}}), "spec.algorithm.topP", "less than or equal to 1", SAME),
    ("top-k", _doc({"algorithm": {"topK": -1}}), "spec.algorithm.topK", ">= 0", SAME),
    ("seed", _doc({"algorithm": {"seed": -1}}), "spec.algorithm.seed", ">= 0", SAME),
    ("eval-every", _doc({"algorithm": {"evalEvery": -2}}), "spec.algorithm.evalEvery", ">= 0", SAME),
    ("size", _doc({"dataset": {"synthetic": {"size": 0}}}), "spec.dataset.synthetic.size", ">= 1", SAME),
    ("difficulty-negative", _doc({"dataset": {"synthetic": {"difficulty": {"hard": -1}}}}),
     "spec.dataset.synthetic.difficulty.hard", ">= 0", SAME),
    ("prompt-field-empty", _doc({"dataset": {"type": "jsonl", "path": "/d.jsonl", "promptField": ""}}),
     "spec.dataset.promptField", "at least 1", SAME),
    ("staleness-range", _doc({"maxStaleness": 99}), "spec.maxStaleness", "<= 64", SAME),
    ("num-spec", _doc({"speculative": {"numSpeculativeTokens": 0}}), "spec.speculative.numSpeculativeTokens",
     ">= 1", SAME),
    ("epsilon", _doc({"speculative": {"adaptive": {"epsilon": 1.5}}}), "spec.speculative.adaptive.epsilon",
     "<= 1", SAME),
    ("window", _doc({"speculative": {"adaptive": {"window": 0}}}), "spec.speculative.adaptive.window", ">= 1", SAME),
    ("buckets-empty", _doc({"speculative": {"adaptive": {"batchSizeBuckets": []}}}),
     "spec.speculative.adaptive.batchSizeBuckets", "at least 1", SAME),
    ("buckets-zero", _doc({"speculative": {"adaptive": {"batchSizeBuckets": [0, 4]}}}),
     "spec.speculative.adaptive.batchSizeBuckets[0]", ">= 1", SAME),
    ("drafter-interval", _doc({"speculative": {"drafterTraining": {"interval": 0}}}),
     "spec.speculative.drafterTraining.interval", ">= 1", SAME),
    ("replicas-zero", _doc({"resources": {"trainer": {"replicas": 0}}}), "spec.resources.trainer.replicas",
     ">= 1", SAME),
    ("gpus-per-pod", _doc({"resources": {"gpusPerPod": 17}}), "spec.resources.gpusPerPod", "<= 16", SAME),
    ("total-gpus-negative", _doc({"resources": {"totalGPUs": -1}}), "spec.resources.totalGPUs", ">= 0", SAME),
    ("image-empty", _doc({"resources": {"image": ""}}), "spec.resources.image", "at least 1", SAME),
    ("toleration-seconds", _doc({"resources": {"podTemplate": {"tolerations": [{"tolerationSeconds": -5}]}}}),
     "spec.resources.podTemplate.tolerations[0].tolerationSeconds", ">= 0", SAME),
    ("quantity", _doc({"resources": {"podTemplate": {"resources": {"requests": {"memory": "lots"}}}}}),
     "spec.resources.podTemplate.resources.requests.memory", "Kubernetes quantity", SAME),
    ("quantity-upper-k", _pt({"resources": {"limits": {"memory": "5K"}}}),
     "spec.resources.podTemplate.resources.limits.memory", "Kubernetes quantity", SAME),
    ("quantity-size-limit", _pt({"volumes": [{"name": "a", "emptyDir": {"sizeLimit": "big"}}]}),
     "spec.resources.podTemplate.volumes[0].emptyDir.sizeLimit", "Kubernetes quantity", SAME),
    ("env-name", _doc({"resources": {"podTemplate": {"env": [{"name": "1 BAD"}]}}}),
     "spec.resources.podTemplate.env[0].name", "environment variable name", SAME),
    ("cooldown", _doc({"elastic": {"cooldownSeconds": -1}}), "spec.elastic.cooldownSeconds", ">= 0", SAME),
    ("long-tail", _doc({"elastic": {"longTailFraction": 0}}), "spec.elastic.longTailFraction", "greater than 0", SAME),
    ("hysteresis", _doc({"elastic": {"hysteresis": 0}}), "spec.elastic.hysteresis", ">= 1", SAME),
    ("drain-timeout", _doc({"elastic": {"drainTimeoutSeconds": 0}}), "spec.elastic.drainTimeoutSeconds", ">= 1", SAME),
    ("bucket-mib", _doc({"weightSync": {"bucketMiB": 0}}), "spec.weightSync.bucketMiB", ">= 1", SAME),
    ("checkpoint-interval", _doc({"checkpoint": {"interval": 0}}), "spec.checkpoint.interval", ">= 1", SAME),
    ("checkpoint-path-empty", _doc({"checkpoint": {"path": ""}}), "spec.checkpoint.path", "at least 1", SAME),
    ("backoff", _doc({"backoffLimit": -1}), "spec.backoffLimit", ">= 0", SAME),
    # --- cross-field rules
    ("builtin-model", _doc({"model": {"name": "builtin:huge"}}), "spec.model.name", "unknown builtin model", SAME),
    ("model-whitespace", _doc({"model": {"name": "Qwen/Qwen3 8B"}}), "spec.model.name", "no whitespace", SAME),
    ("draft-model-whitespace", _doc({"speculative": {"method": "draft_model", "draftModel": "org/draft\tv2"}}),
     "spec.speculative.draftModel", "no whitespace", SAME),
    ("difficulty-zero", _doc({"dataset": {"synthetic": {"difficulty": {"easy": 0, "medium": 0, "hard": 0}}}}),
     "spec.dataset.synthetic.difficulty", "must not all be zero", SAME),
    ("jsonl-needs-path", _doc({"dataset": {"type": "jsonl"}}), "spec.dataset.path", "required when type is jsonl",
     SAME),
    ("synthetic-no-path", _doc({"dataset": {"path": "/x.jsonl"}}), "spec.dataset.path", "only used when type is jsonl",
     SAME),
    ("function-required", _doc({"reward": {"type": "function"}}), "spec.reward.function", "required", SAME),
    ("function-form", _doc({"reward": {"type": "function", "function": "os.system"}}), "spec.reward.function",
     "package.module:function", SAME),
    ("function-code", _doc({"reward": {"type": "function", "function": "lambda x: 1"}}), "spec.reward.function",
     "package.module:function", SAME),
    ("function-unused", _doc({"reward": {"function": "pkg.mod:f"}}), "spec.reward.function", "only used when", SAME),
    ("adaptive-min-max", _doc({"speculative": {"adaptive": {"minDraftTokens": 6, "maxDraftTokens": 3},
                                               "numSpeculativeTokens": 4}}),
     "spec.speculative.adaptive.minDraftTokens", "<= maxDraftTokens", SAME),
    ("buckets-repeat", _doc({"speculative": {"adaptive": {"batchSizeBuckets": [1, 4, 4]}}}),
     "spec.speculative.adaptive.batchSizeBuckets", "must not repeat", "spec.speculative.adaptive.batchSizeBuckets"),
    ("draft-model-required", _doc({"speculative": {"method": "draft_model"}}), "spec.speculative.draftModel",
     "required when method is draft_model", SAME),
    ("eagle3-needs-draft", _doc({"speculative": {"method": "eagle3"}}), "spec.speculative.draftModel",
     "required when method is eagle3", SAME),
    ("draft-model-unused", _doc({"speculative": {"method": "ngram", "draftModel": "x/y"}}),
     "spec.speculative.draftModel", "not used by method ngram", SAME),
    ("draft-model-builtin", _doc({"speculative": {"method": "draft_model", "draftModel": "builtin:nope"}}),
     "spec.speculative.draftModel", "unknown builtin model", SAME),
    ("num-spec-in-bounds", _doc({"speculative": {"numSpeculativeTokens": 12}}),
     "spec.speculative.numSpeculativeTokens", "within adaptive.minDraftTokens..maxDraftTokens", SAME),
    ("min-replicas", _doc({"resources": {"rollout": {"replicas": 2, "minReplicas": 3}}}),
     "spec.resources.rollout.minReplicas", "must be <= replicas", SAME),
    ("max-replicas", _doc({"resources": {"trainer": {"replicas": 4, "maxReplicas": 3}}}),
     "spec.resources.trainer.maxReplicas", "must be >= replicas", SAME),
    ("gpu-in-pod-template", _doc({"resources": {"podTemplate": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}}),
     "spec.resources.podTemplate.resources.limits.nvidia.com/gpu", "gpusPerPod",
     "spec.resources.podTemplate.resources.limits"),
    ("env-duplicate", _doc({"resources": {"podTemplate": {"env": [{"name": "A"}, {"name": "A"}]}}}),
     "spec.resources.podTemplate.env[1].name", "duplicate", SAME),
    ("env-reserved", _doc({"resources": {"podTemplate": {"env": [{"name": "SPECRL_JOB", "value": "x"}]}}}),
     "spec.resources.podTemplate.env[0].name", "set by the operator", SAME),
    # --- Kubernetes pod fields (runtime/podspec.py), common template and per-role overrides
    ("volume-two-sources", _pt({"volumes": [{"name": "d", "emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}}]}),
     "spec.resources.podTemplate.volumes[0]", "exactly one of persistentVolumeClaim", SAME),
    ("volume-no-source", _pt({"volumes": [{"name": "d"}]}),
     "spec.resources.podTemplate.volumes[0]", "exactly one of persistentVolumeClaim", SAME),
    ("volume-name", _pt({"volumes": [{"name": "Data", "emptyDir": {}}]}),
     "spec.resources.podTemplate.volumes[0].name", "should match pattern", SAME),
    ("volume-host-path", _pt({"volumes": [{"name": "n", "hostPath": {"path": "/mnt"}}]}),
     "spec.resources.podTemplate.volumes[0].hostPath", "refused unless allowHostPath", "spec.resources.podTemplate.volumes"),
    ("volume-reserved", _pt({"volumes": [{"name": "config", "emptyDir": {}}]}),
     "spec.resources.podTemplate.volumes[0].name", "reserved for the operator", "spec.resources.podTemplate.volumes"),
    ("volume-duplicate", _pt({"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}),
     "spec.resources.podTemplate.volumes[1].name", "duplicate volume", None),
    ("pvc-claim-missing", _pt({"volumes": [{"name": "a", "persistentVolumeClaim": {}}]}),
     "spec.resources.podTemplate.volumes[0].persistentVolumeClaim.claimName", "required",
     "spec.resources.podTemplate.volumes[0].persistentVolumeClaim"),
    ("mount-unknown-volume", _pt({"volumeMounts": [{"name": "data", "mountPath": "/data"}]}),
     "spec.resources.podTemplate.volumeMounts[0].name", "no volume named 'data' in the coordinator pods", None),
    ("mount-unknown-in-role", _doc({"resources": {"podTemplate": {"volumes": [{"name": "a", "emptyDir": {}}]},
                                                 "trainer": {"podTemplate": {"volumeMounts": [
                                                     {"name": "b", "mountPath": "/b"}]}}}}),
     "spec.resources.trainer.podTemplate.volumeMounts[0].name", "no volume named 'b' in the trainer pods", None),
    ("mount-role-volume", _doc({"resources": {"podTemplate": {"volumeMounts": [{"name": "a", "mountPath": "/a"}]},
                                             "coordinator": {"podTemplate": {"volumes": [{"name": "a", "emptyDir": {}}]}},
                                             "trainer": {"podTemplate": {"volumes": [{"name": "a", "emptyDir": {}}]}}}}),
     "spec.resources.podTemplate.volumeMounts[0].name", "in the rollout pods", None),
    ("mount-relative", _mount_at("data"),
     "spec.resources.podTemplate.volumeMounts[0].mountPath", "should match pattern", SAME),
    ("mount-reserved-path", _mount_at("/etc/specrl"),
     "spec.resources.podTemplate.volumeMounts[0].mountPath", "overlaps the operator's mounts",
     "spec.resources.podTemplate.volumeMounts"),
    ("mount-reserved-trailing-slash", _mount_at("/etc/specrl/"),
     "spec.resources.podTemplate.volumeMounts[0].mountPath", "overlaps the operator's mounts",
     "spec.resources.podTemplate.volumeMounts"),
    ("mount-reserved-ancestor", _mount_at("/dev"),
     "spec.resources.podTemplate.volumeMounts[0].mountPath", "overlaps the operator's mounts",
     "spec.resources.podTemplate.volumeMounts"),
    ("mount-reserved-inside", _mount_at("/dev/shm/x"),
     "spec.resources.podTemplate.volumeMounts[0].mountPath", "overlaps the operator's mounts",
     "spec.resources.podTemplate.volumeMounts"),
    ("mount-duplicate-path", _pt({"volumes": [{"name": "a", "emptyDir": {}}],
                                  "volumeMounts": [{"name": "a", "mountPath": "/a"}, {"name": "a", "mountPath": "/a/"}]}),
     "spec.resources.podTemplate.volumeMounts[1].mountPath", "duplicate mountPath", None),
    ("env-value-and-from", _pt({"env": [{"name": "T", "value": "x", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}),
     "spec.resources.podTemplate.env[0].valueFrom", "mutually exclusive", SAME),
    ("env-from-two-sources", _pt({"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"},
                                                                      "fieldRef": {"fieldPath": "spec.nodeName"}}}]}),
     "spec.resources.podTemplate.env[0].valueFrom", "exactly one of secretKeyRef", SAME),
    ("env-secret-key-missing", _pt({"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}),
     "spec.resources.podTemplate.env[0].valueFrom.secretKeyRef.key", "required",
     "spec.resources.podTemplate.env[0].valueFrom.secretKeyRef"),
    ("envfrom-no-source", _pt({"envFrom": [{"prefix": "A_"}]}),
     "spec.resources.podTemplate.envFrom[0]", "exactly one of configMapRef, secretRef", SAME),
    ("affinity-operator", _pt({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Is"}]}]}}}}),
     ("spec.resources.podTemplate.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
     ".nodeSelectorTerms[0].matchExpressions[0].operator"), "must be one of", SAME),
    ("affinity-weight", _pt({"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 500, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]}}}),
     "spec.resources.podTemplate.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight",
     "<= 100", SAME),
    ("spread-unsatisfiable", _pt({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]}),
     "spec.resources.podTemplate.topologySpreadConstraints[0].whenUnsatisfiable", "required",
     "spec.resources.podTemplate.topologySpreadConstraints[0]"),
    ("pull-secret-name", _pt({"imagePullSecrets": [{"name": ""}]}),
     "spec.resources.podTemplate.imagePullSecrets[0].name", "at least 1", SAME),
    # --- what the API server would refuse in the pods (label keys and values, resource names)
    ("label-value-long", _pt({"labels": {"team": "a" * 64}}), "spec.resources.podTemplate.labels.team",
     "at most 63 characters", SAME),
    ("label-value-charset", _pt({"labels": {"team": "ml team"}}), "spec.resources.podTemplate.labels.team",
     "valid label value", SAME),
    ("label-key-name", _pt({"labels": {"-team": "ml"}}), "spec.resources.podTemplate.labels.-team",
     "invalid key: name part", "spec.resources.podTemplate.labels"),
    ("label-key-long", _pt({"labels": {"k" * 64: "v"}}), "spec.resources.podTemplate.labels." + "k" * 64,
     "invalid key: name part must be at most 63", "spec.resources.podTemplate.labels"),
    ("label-key-prefix", _pt({"labels": {"Example.com/team": "ml"}}),
     "spec.resources.podTemplate.labels.Example.com/team", "invalid key: prefix", "spec.resources.podTemplate.labels"),
    ("labels-too-many", _pt({"labels": {f"k{i}": "v" for i in range(65)}}), "spec.resources.podTemplate.labels",
     "at most 64 items", SAME),
    ("annotation-key", _pt({"annotations": {"a/b/c": "x"}}), "spec.resources.podTemplate.annotations.a/b/c",
     "invalid key", "spec.resources.podTemplate.annotations"),
    ("annotations-size", _pt({"annotations": {"note": "x" * (256 * 1024)}}), "spec.resources.podTemplate.annotations",
     "bytes in all", None),
    ("annotations-too-many", _pt({"annotations": {f"k{i}": "v" for i in range(65)}}),
     "spec.resources.podTemplate.annotations", "at most 64 items", SAME),
    ("node-selector-value", _pt({"nodeSelector": {"pool": "p" * 64}}), "spec.resources.podTemplate.nodeSelector.pool",
     "at most 63 characters", SAME),
    ("node-selector-key", _pt({"nodeSelector": {"gpu pool": "a"}}),
     "spec.resources.podTemplate.nodeSelector.gpu pool", "invalid key", "spec.resources.podTemplate.nodeSelector"),
    ("resource-name", _pt({"resources": {"requests": {"bogus": "1"}}}),
     "spec.resources.podTemplate.resources.requests.bogus", "not a standard resource",
     "spec.resources.podTemplate.resources.requests"),
    ("resource-name-form", _doc({"resources": {"rollout": {"podTemplate": {"resources": {"limits": {"a/b/c": 1}}}}}}),
     "spec.resources.rollout.podTemplate.resources.limits.a/b/c", "optional DNS subdomain prefix",
     "spec.resources.rollout.podTemplate.resources.limits"),
    ("pod-fields-ok", _pt({"labels": {"app.kubernetes.io/part-of": "specrl", "kueue.x-k8s.io/queue-name": "q",
                                      "empty": ""},
                           "annotations": {"Example.com/Note": "free text, any length: " + "x" * 100},
                           "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                           "resources": {"requests": {"cpu": "500m", "memory": "1Gi", "ephemeral-storage": "10Gi",
                                                      "hugepages-2Mi": "1Gi", "example.com/fpga": 1}},
                           "volumes": [{"name": "a", "emptyDir": {}}],
                           "volumeMounts": [{"name": "a", "mountPath": "/etc/specrl2"}]}), "", "", SAME),
    ("scheduler-type", _pt({"schedulerName": 3}), "spec.resources.podTemplate.schedulerName", "valid string", SAME),
    ("role-gpu", _doc({"resources": {"coordinator": {"podTemplate": {"resources": {"limits": {"nvidia.com/gpu": 1}}}}}}),
     "spec.resources.coordinator.podTemplate.resources.limits.nvidia.com/gpu", "gpusPerPod",
     "spec.resources.coordinator.podTemplate.resources.limits"),
    ("role-env-reserved", _doc({"resources": {"rollout": {"podTemplate": {"env": [{"name": "SPECRL_ROLE"}]}}}}),
     "spec.resources.rollout.podTemplate.env[0].name", "set by the operator", SAME),
    ("gpu-budget", _doc({"resources": {"gpusPerPod": 2, "totalGPUs": 6, "trainer": {"replicas": 2},
                                       "rollout": {"replicas": 2}}}),
     "spec.resources.totalGPUs", "exceeds totalGPUs 6", SAME),
    ("gpu-budget-min", _doc({"resources": {"gpusPerPod": 1, "totalGPUs": 4, "trainer": {"replicas": 2, "minReplicas": 2},
                                           "rollout": {"replicas": 2, "minReplicas": 2}}}), "", "", None),
    ("queue-watermarks", _doc({"elastic": {"queueHighWatermark": 8, "queueLowWatermark": 8}}),
     "spec.elastic.queueLowWatermark", "< queueHighWatermark", SAME),
    ("async-staleness", _doc({"mode": "async", "maxStaleness": 0}), "spec.maxStaleness",
     "async mode needs maxStaleness >= 1", SAME),
    ("nccl-needs-gpus", _doc({"weightSync": {"backend": "nccl"}, "resources": {"gpusPerPod": 0}}),
     "spec.weightSync.backend", "nccl needs GPUs", SAME),
    ("eagle3-needs-vllm", _doc({"speculative": {"method": "eagle3", "draftModel": "org/head"}}),
     "spec.rolloutEngine", "runs on the vLLM engine only", SAME),
    ("vllm-has-no-layer-skip", _doc({"rolloutEngine": "vllm", "speculative": {"method": "layer_skip"}}),
     "spec.rolloutEngine", "native engine only", SAME),
    ("vllm-needs-gpus", _doc({"rolloutEngine": "vllm", "resources": {"gpusPerPod": 0}}),
     "spec.rolloutEngine", "needs GPUs", SAME),
    ("vllm-eagle3-ok", _doc({"rolloutEngine": "vllm", "speculative": {"method": "mtp"}}), "", "", SAME),
    ("collective-timeout-vs-progress", _doc({"faultTolerance": {"collectiveTimeoutSeconds": 600},
                                             "progressDeadlineSeconds": 1200}),
     "spec.faultTolerance.collectiveTimeoutSeconds", "must be under progressDeadlineSeconds", SAME),
    ("collective-timeout-no-deadline", _doc({"faultTolerance": {"collectiveTimeoutSeconds": 3600},
                                             "progressDeadlineSeconds": 0}), "", "", SAME),
]

_CRD = CRDSchema(build_crd())


def _crd_causes(doc: dict[str, Any]) -> list[tuple[str, str]]:
    try:
        _CRD.admit(doc, field_validation="Strict")
    except AdmissionError as exc:
        return exc.causes
    return []


@pytest.mark.parametrize(("doc", "path", "fragment", "crd_path"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule_reports_the_exact_field_path(doc: dict[str, Any], path: str, fragment: str, crd_path: Any) -> None:
    if not path:  # a control case: valid, and the CRD agrees
        parse_job(doc)
        assert _crd_causes(doc) == []
        return
    with pytest.raises(JobValidationError) as info:
        parse_job(copy.deepcopy(doc), source="f.yaml")
    problems = info.value.problems
    assert path in [p.path for p in problems], [str(p) for p in problems]
    message = next(p.message for p in problems if p.path == path)
    assert fragment in message or fragment.replace(">= ", "greater than or equal to ") in message \
        or fragment.replace("<= ", "less than or equal to ") in message, message
    line = str(next(p for p in problems if p.path == path))
    assert line.startswith(f"f.yaml: {doc['metadata'].get('name') or '<unnamed>'}: {path}: ")
    if crd_path is None:
        return
    expected = path if crd_path is SAME else crd_path
    causes = _crd_causes(doc)
    assert expected in [c[0] for c in causes], causes


def test_every_cross_field_rule_has_a_case() -> None:
    # Each model validator's rule messages appear in at least one case above.
    covered = " ".join(c[3] for c in CASES)
    for phrase in ("unknown builtin model", "no whitespace", "must not all be zero", "required when type is jsonl",
                   "only used when type is jsonl", "<= maxDraftTokens", "must not repeat", "not used by method",
                   "within adaptive.minDraftTokens", "must be <= replicas", "must be >= replicas", "gpusPerPod",
                   "duplicate", "set by the operator", "exceeds totalGPUs", "< queueHighWatermark",
                   "async mode needs maxStaleness", "nccl needs GPUs", "only used when", "exactly one of",
                   "refused unless allowHostPath", "reserved for the operator", "no volume named",
                   "overlaps the operator's mounts", "duplicate mountPath", "duplicate volume", "mutually exclusive",
                   "must be under progressDeadlineSeconds", "invalid key", "not a standard resource",
                   "bytes in all"):
        assert phrase in covered, phrase


def test_minimal_job_is_valid_with_defaults() -> None:
    job = parse_job(_doc())
    assert job.spec.model.name == "builtin:tiny"
    assert job.spec.algorithm.group_size == 8 and job.spec.algorithm.learning_rate == 1e-5
    assert job.spec.speculative.method == "none" and job.spec.mode == "sync"
    assert job.namespace == "default"
    assert _crd_causes(_doc()) == []
    # No spec at all is valid too (the CRD defaults spec to {}).
    assert parse_job({"apiVersion": API_VERSION, "kind": "RLJob", "metadata": {"name": "job"}}).spec.suspend is False


def test_wrong_api_version_and_kind_are_reported_alone() -> None:
    with pytest.raises(JobValidationError) as info:
        parse_job({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": []}})
    assert [p.path for p in info.value.problems] == ["apiVersion", "kind"]
    with pytest.raises(JobValidationError) as info:
        parse_job(["not", "a", "mapping"])
    assert "expected a mapping" in info.value.problems[0].message


def test_camel_case_aliases_and_snake_case_python_names() -> None:
    job = RLJob.model_validate(_doc({"resources": {"totalGPUs": 4, "gpusPerPod": 1, "trainer": {"replicas": 2},
                                                   "rollout": {"replicas": 2}},
                                     "weightSync": {"bucketMiB": 64}}))
    assert job.spec.resources.total_gpus == 4 and job.spec.weight_sync.bucket_mib == 64
    dumped = job.to_dict()
    assert dumped["spec"]["resources"]["totalGPUs"] == 4
    assert dumped["spec"]["weightSync"]["bucketMiB"] == 64
    assert dumped["spec"]["algorithm"]["maxNewTokens"] == 128
    assert "status" not in dumped


def test_resolved_fills_derived_defaults() -> None:
    job = parse_job(_doc({"resources": {"gpusPerPod": 2, "trainer": {"replicas": 2}, "rollout": {"replicas": 3}}}))
    r = job.resolved()
    assert r.spec.resources.total_gpus == 10
    assert r.spec.weight_sync.backend == "nccl"
    assert r.spec.resources.trainer.max_replicas == 2 and r.spec.resources.rollout.max_replicas == 3  # not elastic
    elastic = parse_job(_doc({"elastic": {"enabled": True}, "resources": {
        "gpusPerPod": 1, "totalGPUs": 8, "trainer": {"replicas": 3, "minReplicas": 2},
        "rollout": {"replicas": 5, "minReplicas": 1}}})).resolved()
    assert elastic.spec.resources.trainer.max_replicas == 7  # 8 pods of budget - rollout's minimum of 1
    assert elastic.spec.resources.rollout.max_replicas == 6
    cpu = parse_job(_doc({"resources": {"gpusPerPod": 0}})).resolved()
    assert cpu.spec.weight_sync.backend == "gloo" and cpu.spec.resources.total_gpus == 0
    assert job.spec.resources.total_gpus is None  # resolved() returns a copy


def test_config_yaml_round_trips(tmp_path) -> None:
    job = parse_job(_doc({"speculative": {"method": "draft_model", "draftModel": "builtin:tiny-draft"}},
                         metadata={"name": "job", "namespace": "ml", "uid": "u-1", "resourceVersion": "7",
                                   "finalizers": ["kopf.zalando.org/KopfFinalizerMarker"]},
                         status={"phase": "Running", "kopf": {"progress": {}}}))
    path = tmp_path / "job.yaml"
    path.write_text(job.config_yaml())
    again = api.load_job(path)
    assert again == job.resolved().model_copy(update={"status": None, "metadata": again.metadata})
    assert again.metadata.uid is None and again.metadata.namespace == "ml"


def test_status_keeps_kopf_state_and_unknown_keys() -> None:
    job = RLJob.model_validate(_doc(status={"phase": "Running", "kopf": {"dummy": 1}, "step": 3,
                                            "allocation": {"trainer": {"replicas": 1, "gpus": 1}}}))
    assert job.status is not None and job.status.step == 3
    assert job.to_dict(status=True)["status"]["kopf"] == {"dummy": 1}


def test_batch_size_buckets_are_kept_sorted() -> None:
    job = parse_job(_doc({"speculative": {"adaptive": {"batchSizeBuckets": [21, 1, 5]}}}))
    assert job.spec.speculative.adaptive.batch_size_buckets == [1, 5, 21]


def test_yaml_floats_in_exponent_form_are_numbers() -> None:
    (doc,) = api.load_yaml_documents("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: j}\n"
                                     "spec: {algorithm: {learningRate: 1e-5}}\n")
    assert parse_job(doc).spec.algorithm.learning_rate == 1e-5


# ----------------------------------------------------------------------------------------------------------
# The models and the CRD agree on generated specs (the cross-field rules and their CEL twins).

VOLUMES: list[dict[str, Any]] = [{"name": "a", "emptyDir": {}}, {"name": "h", "hostPath": {"path": "/x"}},
                                  {"name": "b"}, {"name": "config", "emptyDir": {}}]
_specs = st.fixed_dictionaries({}, optional={
    "mode": st.sampled_from(["sync", "async"]),
    "maxStaleness": st.integers(0, 3),
    "speculative": st.fixed_dictionaries({}, optional={
        "method": st.sampled_from(list(api.SPECULATIVE_METHODS)),
        "draftModel": st.sampled_from(["builtin:tiny-draft", "builtin:zzz", "org/drafter"]),
        "numSpeculativeTokens": st.integers(1, 10),
        "adaptive": st.fixed_dictionaries({}, optional={"minDraftTokens": st.integers(1, 6),
                                                        "maxDraftTokens": st.integers(1, 10)}),
    }),
    "resources": st.fixed_dictionaries({}, optional={
        "gpusPerPod": st.integers(0, 2),
        "totalGPUs": st.integers(0, 10),
        "trainer": st.fixed_dictionaries({}, optional={"replicas": st.integers(1, 4), "minReplicas": st.integers(1, 4),
                                                      "maxReplicas": st.integers(1, 5)}),
        "rollout": st.fixed_dictionaries({}, optional={"replicas": st.integers(1, 4), "minReplicas": st.integers(1, 4),
                                                      "maxReplicas": st.integers(1, 5)}),
        "podTemplate": st.fixed_dictionaries({}, optional={
            "env": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["A", "B", "SPECRL_X"])}), max_size=3),
            "volumes": st.lists(st.sampled_from(VOLUMES),
                                max_size=2, unique_by=lambda v: v["name"]),
            "allowHostPath": st.booleans(),
            "resources": st.fixed_dictionaries({}, optional={
                "limits": st.dictionaries(st.sampled_from(["cpu", "nvidia.com/gpu"]), st.sampled_from([1, "2"]),
                                          max_size=2)}),
        }),
    }),
    "model": st.fixed_dictionaries({}, optional={"name": st.sampled_from(["builtin:tiny", "builtin:x", "org/m"])}),
    "weightSync": st.fixed_dictionaries({}, optional={"backend": st.sampled_from(["nccl", "gloo"])}),
    "elastic": st.fixed_dictionaries({}, optional={"queueHighWatermark": st.integers(1, 4),
                                                  "queueLowWatermark": st.integers(0, 4)}),
    "reward": st.fixed_dictionaries({}, optional={"type": st.sampled_from(["exact_match", "function"]),
                                                 "function": st.sampled_from(["pkg.mod:fn", "bad"])}),
    "dataset": st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["synthetic", "jsonl"]), "path": st.sampled_from(["/data/a.jsonl"]),
        "synthetic": st.fixed_dictionaries({}, optional={"difficulty": st.fixed_dictionaries(
            {}, optional={"easy": st.sampled_from([0, 0.5]), "medium": st.sampled_from([0, 1]),
                          "hard": st.sampled_from([0.0, 0.2])})})}),
})


@settings(max_examples=200, deadline=None)
@given(_specs)
def test_models_and_crd_agree(spec: dict[str, Any]) -> None:
    doc = _doc(spec)
    try:
        parse_job(copy.deepcopy(doc))
        model_ok = True
    except JobValidationError:
        model_ok = False
    assert model_ok == (not _crd_causes(doc)), (spec, _crd_causes(doc))


def _both_accept(doc: dict[str, Any]) -> tuple[bool, bool]:
    try:
        parse_job(copy.deepcopy(doc))
        model_ok = True
    except JobValidationError:
        model_ok = False
    return model_ok, not _crd_causes(doc)


@pytest.mark.parametrize("mount_path", [
    "/etc/specrl", "/etc/specrl/", "/etc/specrl//", "/etc/specrl/x", "/etc", "/etc/", "/etc//", "/dev", "/dev/shm/",
    "/dev/shm/a/b", "/dev/shmx", "/etc/specrl2", "/etc/spec", "/e", "//", "/data", "/devices"])
def test_mount_overlap_rule_and_its_cel_twin_agree(mount_path: str) -> None:
    doc = _mount_at(mount_path)
    model_ok, crd_ok = _both_accept(doc)
    assert model_ok == crd_ok


@pytest.mark.parametrize("key", [
    "app", "A.b-c_d", "app.kubernetes.io/name", "x" * 63, "x" * 64, "-a", "a-", "a b", "a/b/c", "/a", "a/",
    "Example.com/a", "ex_ample.com/a", "ex..com/a", "a." * 20 + "com/x", "nvidia.com/gpu.product"])
@pytest.mark.parametrize("field", ["labels", "nodeSelector"])
def test_label_key_rule_and_its_cel_twin_agree(field: str, key: str) -> None:
    model_ok, crd_ok = _both_accept(_pt({field: {key: "v"}}))
    assert model_ok == crd_ok


@pytest.mark.parametrize("name", ["cpu", "memory", "ephemeral-storage", "hugepages-1Gi", "hugepages-", "gpu",
                                  "nvidia.com/gpu", "example.com/fpga", "Example.com/fpga", "a/b/c", "CPU"])
def test_resource_name_rule_and_its_cel_twin_agree(name: str) -> None:
    model_ok, crd_ok = _both_accept(_pt({"resources": {"limits": {name: 1}}}))
    assert model_ok == crd_ok


def test_crd_admission_ratchets_unchanged_invalid_fields() -> None:
    # An object stored before a rule existed keeps taking status writes; changing the bad field is refused.
    bad = _doc({"mode": "async", "maxStaleness": 0})
    assert _crd_causes(bad)
    with_status = {**bad, "status": {"phase": "Failed"}}
    _CRD.admit(with_status, old=bad)
    changed = _doc({"mode": "async", "maxStaleness": 0, "suspend": True})
    _CRD.admit(changed, old=bad)  # unrelated edit: tolerated
    with pytest.raises(AdmissionError):
        _CRD.admit(_doc({"mode": "async", "maxStaleness": 0, "algorithm": {"steps": 0}}), old=bad)


def test_collective_timeout_is_tied_to_the_progress_deadline() -> None:
    from specrl.runtime.rl.settings import RunSettings

    def timeout(**spec: Any) -> float:
        return RunSettings.from_job(parse_job(_doc(spec))).collective_timeout_s

    assert timeout() == 300.0  # the default deadline (3600 s) allows the cap
    assert timeout(progressDeadlineSeconds=300) == 75.0  # found after at most 150 s, well before the deadline
    assert timeout(progressDeadlineSeconds=0) == 300.0  # no deadline: the cap
    assert timeout(progressDeadlineSeconds=300, faultTolerance={"collectiveTimeoutSeconds": 20}) == 20.0
