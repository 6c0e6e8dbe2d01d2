"""Scenario files for `specrl simulate`: what cluster, model, workload and speculation policy to simulate.

A scenario is YAML validated by these models (unknown keys are errors, like everywhere in specrl). Presets are
scenarios shipped under `presets/`; every number in them that comes from a paper says where it came from.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..api import format_path, load_yaml_documents, yaml_error_message

PRESETS = Path(__file__).with_name("presets")

Drafter = Literal["none", "draft_model", "ngram", "layer_skip", "quantized_self", "eagle", "eagle3", "mtp"]

# Upper bounds: far above any real job, low enough that the simulation of one still ends (it simulates every step,
# every rollout instance and every trainer split it tries).
MAX_GPUS = 65_536  # the largest training clusters hold tens of thousands of GPUs
MAX_STEPS = 10_000  # RL runs are hundreds to a few thousand steps
MAX_TOKENS = 1_048_576  # a 1M-token context
MAX_SEQUENCES = 65_536  # prompts per step, concurrent sequences per instance
MAX_LENGTHS = 1_000_000  # empirical lengths listed in a scenario

Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
Probability = Annotated[float, Field(ge=0, le=1)]
Gamma = Annotated[int, Field(ge=1, le=16)]


class _Strict(BaseModel):
    # inf and nan pass `ge=0` and then never end (or never compare) in the event simulation
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Cluster(_Strict):
    gpu: str = Field("H100", description="accelerator name from data/hardware.yaml")
    gpus: int = Field(8, ge=1, le=MAX_GPUS, description=f"GPUs in the job's pool (trainer + rollout), at most {MAX_GPUS}")

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, name: str) -> str:
        from .hardware import gpu

        gpu(name)  # ValueError naming the known ones
        return name


class Efficiency(_Strict):
    bandwidth: float = Field(0.75, gt=0, le=1, description="achieved / peak HBM bandwidth in decode")
    decode_mfu: float = Field(0.5, gt=0, le=1, description="achieved / peak FLOP/s when decode is compute-bound")
    prefill_mfu: float = Field(0.5, gt=0, le=1)
    step_overhead_ms: float = Field(2.0, ge=0, description="fixed cost of one engine step (launch, scheduling)")
    per_seq_overhead_us: float = Field(10.0, ge=0, description="per-sequence cost of one step (sampling, bookkeeping)")
    sync_efficiency: float = Field(0.7, gt=0, le=1, description="achieved / peak link bandwidth for weight sync")


class Rollout(_Strict):
    tensor_parallel: int = Field(1, ge=1, le=1024, description="GPUs per inference instance (at most 1024)")
    max_batch: int = Field(256, ge=1, le=MAX_SEQUENCES, description=(
        f"max concurrent sequences per instance (vLLM max_num_seqs), at most {MAX_SEQUENCES}"))
    efficiency: Efficiency = Efficiency()


class Training(_Strict):
    mfu: float = Field(0.35, gt=0, le=1, description="model FLOPs utilisation of the trainer")
    recompute_logprobs: bool = Field(True, description="an extra forward for the old-policy logprobs")
    reference_model: bool = Field(False, description="an extra forward for the KL reference")
    fixed_overhead_s: float = Field(0.0, ge=0, description="per step: optimizer, checkpoints, data loading")


class Response(_Strict):
    distribution: Literal["lognormal", "pareto", "empirical"] = "lognormal"
    median: float = Field(1000, gt=0, le=MAX_TOKENS, description=f"median response length (tokens), at most {MAX_TOKENS}")
    sigma: float = Field(0.8, gt=0, le=10, description="lognormal shape (at most 10)")
    alpha: float = Field(1.5, gt=0, le=100, description="pareto tail index (at most 100)")
    min: int = Field(16, ge=1, le=MAX_TOKENS, description="responses shorter than this are lengthened to it")
    max: int = Field(16384, ge=1, le=MAX_TOKENS, description=(
        f"max new tokens: responses are truncated here (at most {MAX_TOKENS})"))
    lengths: list[Tokens] = Field(default_factory=list, max_length=MAX_LENGTHS, description=(
        f"empirical lengths (distribution: empirical), each 1..{MAX_TOKENS}, at most {MAX_LENGTHS} of them"))
    exact: bool = Field(False, description="empirical: use exactly these lengths every step instead of resampling")
    metrics_file: str | None = Field(None, min_length=1, description=(
        "a `specrl run` metrics.jsonl to take empirical lengths from"))

    @model_validator(mode="after")
    def _check(self) -> Response:
        if self.min > self.max:
            raise ValueError(f"workload.response.min: must be <= max ({self.max}), got {self.min}")
        if self.distribution == "empirical" and not self.lengths and not self.metrics_file:
            raise ValueError("workload.response.lengths: distribution empirical needs lengths or metrics_file")
        return self


class Workload(_Strict):
    steps: int = Field(8, ge=1, le=MAX_STEPS, description=f"RL steps to simulate, at most {MAX_STEPS}")
    prompts_per_step: int = Field(128, ge=1, le=MAX_SEQUENCES, description=f"at most {MAX_SEQUENCES}")
    group_size: int = Field(8, ge=1, le=1024, description="responses per prompt, at most 1024")
    prompt_tokens: int = Field(256, ge=1, le=MAX_TOKENS, description=f"at most {MAX_TOKENS}")
    response: Response = Response()
    length_growth_per_step: float = Field(0.0, ge=0, le=1, description=(
        "relative growth of the median length per RL step, 0..1 (1: doubling every step)"))
    seed: int = 0


class Acceptance(_Strict):
    alpha: float = Field(0.7, ge=0, lt=1, description="per-token acceptance probability of the drafter")
    per_position: list[Probability] = Field(default_factory=list, max_length=64, description=(
        "acceptance per draft position, each 0..1 (overrides alpha)"))
    drift_per_step: float = Field(0.0, ge=0, description="alpha lost per RL step while the drafter is stale")
    min_alpha: float = Field(0.2, ge=0, lt=1)


class DrafterTraining(_Strict):
    enabled: bool = False
    interval: int = Field(1, ge=1, description="RL steps between drafter updates")
    recovery: float = Field(1.0, ge=0, le=1, description="share of the lost acceptance a drafter update wins back")


class Speculative(_Strict):
    drafter: Drafter = "none"
    draft_model: str | None = Field(None, description="model name for drafter: draft_model (data/hardware.yaml)")
    quant_bits: int = Field(4, ge=2, le=16, description="weight bits of the quantized_self drafter")
    skip_fraction: float = Field(0.5, gt=0, lt=1, description="share of layers a layer_skip drafter runs")
    num_speculative_tokens: int = Field(3, ge=1, le=16)
    policy: Literal["always", "toggle", "adaptive"] = Field(
        "adaptive", description="always: fixed gamma; toggle: on when predicted gain; adaptive: toggle + best gamma"
    )
    gamma_choices: list[Gamma] = Field(default_factory=lambda: [1, 2, 3, 4, 5, 6, 8], min_length=1, max_length=16,
                                       description="draft lengths the adaptive policy picks from, each 1..16")
    toggle_margin: float = Field(0.05, ge=0)
    overhead_ms: float = Field(0.5, ge=0, description="per SD iteration: rejection sampling, bookkeeping")
    acceptance: Acceptance = Acceptance()
    drafter_training: DrafterTraining = DrafterTraining()

    @field_validator("draft_model")
    @classmethod
    def _known_draft_model(cls, name: str | None) -> str | None:
        from .hardware import model

        if name is not None:
            model(name)  # ValueError naming the known ones
        return name


class Elastic(_Strict):
    enabled: bool = False
    poll_seconds: float = Field(10.0, ge=0.1, description=(
        "how often the operator polls the coordinator (at least 0.1: every poll is simulated)"))
    drain_seconds: float = Field(20.0, ge=0, description="drain of the victim worker")
    startup_seconds: float = Field(60.0, ge=0, description="pod start, model load and group rebuild")
    cooldown_seconds: float = Field(120.0, ge=0)
    long_tail_fraction: float = Field(0.25, gt=0, le=1)
    queue_high_watermark: int = Field(64, ge=0, description="queued prompts per rollout worker that pull GPUs")
    queue_low_watermark: int = Field(0, ge=0, description="queued prompts per rollout worker below which GPUs may leave")
    trainer_backlog_high_watermark: int = Field(0, ge=0, description="0: one step's prompts")
    hysteresis: int = Field(3, ge=1, description="consecutive polls that must agree before a move")
    max_pods_per_move: int = Field(1, ge=1)
    min_trainer_gpus: int = Field(1, ge=1)
    min_rollout_gpus: int = Field(1, ge=1)


class Expect(_Strict):
    """Published results a preset reproduces (the fidelity tests compare against these)."""

    rollout_speedup: float | None = None
    rollout_tolerance: float = 0.15
    end_to_end_speedup: float | None = None
    end_to_end_tolerance: float = 0.20
    end_to_end_min: float | None = None
    rollout_latency_reduction: float | None = Field(None, description="published 1 - SD/AR rollout latency")
    end_to_end_latency_reduction: float | None = None
    reduction_tolerance: float = Field(0.05, description="absolute tolerance on the reductions (points)")
    source: str = ""


class Calibration(_Strict):
    """Costs measured on a real machine that replace the roofline: the `calibration` section that
    `specrl bench rollout --json` writes (the engine's own cost model, in units of one target step)."""

    target_step_ms: dict[int, float] = Field(description="batch size -> ms of one plain decode step")
    v: dict[int, dict[int, float]] = Field(description="batch -> gamma -> verify(gamma+1 tokens) / target step")
    r: dict[str, dict[int, float]] = Field(default_factory=dict, description="proposer -> batch -> draft / target step")
    overhead: dict[str, dict[int, float]] = Field(default_factory=dict,
                                                  description="proposer -> batch -> fixed per-round cost / target step")
    alpha: dict[str, float] = Field(default_factory=dict, description="acceptance seen while calibrating")
    seconds: float | None = None


class Scenario(_Strict):
    name: str = "scenario"
    description: str = ""
    sources: list[str] = Field(default_factory=list)
    cluster: Cluster = Cluster()
    model: str = Field("Qwen3-8B", description="model name from data/hardware.yaml")
    placement: Literal["colocated", "split"] = "split"
    trainer_gpus: int | None = Field(None, ge=1, le=MAX_GPUS, description="split placement: trainer share of the pool")
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = Field(1, ge=0)
    rollout: Rollout = Rollout()
    training: Training = Training()
    workload: Workload = Workload()
    speculative: Speculative = Speculative()
    elastic: Elastic = Elastic()
    calibration: Calibration | None = None
    expect: Expect = Expect()

    @field_validator("model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        from .hardware import model

        model(name)  # ValueError naming the known ones
        return name

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        if self.placement == "split":
            if self.cluster.gpus < 2:
                raise ValueError("cluster.gpus: a split placement needs at least 2 GPUs")
            t = self.trainer_gpus if self.trainer_gpus is not None else self.cluster.gpus // 2
            if not 1 <= t < self.cluster.gpus:
                raise ValueError(f"trainer_gpus: must be between 1 and cluster.gpus-1 ({self.cluster.gpus - 1}), got {t}")
            if (self.cluster.gpus - t) < self.rollout.tensor_parallel:
                raise ValueError("trainer_gpus: leaves fewer rollout GPUs than rollout.tensor_parallel")
        if self.speculative.drafter == "draft_model" and not self.speculative.draft_model:
            raise ValueError("speculative.draft_model: required when drafter is draft_model")
        if self.mode == "async" and self.placement == "colocated":
            raise ValueError("mode: async needs placement: split (colocated roles cannot overlap)")
        return self

    @property
    def split_trainer_gpus(self) -> int:
        return self.trainer_gpus if self.trainer_gpus is not None else self.cluster.gpus // 2


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def load_scenario(path: str | Path | None = None, preset: str | None = None) -> Scenario:
    """Load a scenario file or a preset; errors name the file and the field, one line each."""
    if preset is not None:
        path = PRESETS / f"{preset}.yaml"
        if not path.exists():
            raise ValueError(f"unknown preset {preset!r}; known: {', '.join(list_presets())}")
    if path is None:
        raise ValueError("give a scenario file or --preset NAME")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: cannot read: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        # the RLJob loader: duplicate keys are errors (not silently the last one), nesting is bounded
        docs = load_yaml_documents(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: {yaml_error_message(exc)}") from None
    if len(docs) != 1 or not isinstance(docs[0], dict):
        found = f"{len(docs)} documents" if len(docs) != 1 else type(docs[0]).__name__
        raise ValueError(f"{path}: a scenario must be one mapping, got {found}")
    try:
        scenario = Scenario.model_validate(docs[0])
    except ValidationError as exc:
        raise ValueError("\n".join(f"{path}: {problem}" for problem in validation_problems(exc))) from None
    if scenario.workload.response.distribution == "empirical":
        from .workload import empirical_lengths

        try:
            empirical_lengths(scenario.workload.response)  # a missing or broken metrics_file fails here, not mid-run
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return scenario


def validation_problems(exc: ValidationError) -> list[str]:
    """`field.path: message` of each error. A validator of ours that names its field (`cluster.gpus: ...`) gives
    its own path; pydantic's wording is made to read like the RLJob's."""
    out = []
    for err in exc.errors(include_url=False):
        where, msg = format_path(err["loc"]), err["msg"]
        if err["type"] == "value_error":
            msg = str(err["ctx"]["error"])
            field, sep, rest = msg.partition(": ")
            if sep and re.fullmatch(r"[a-z_][a-z0-9_.]*", field):
                where, msg = field, rest
        elif err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "missing":
            msg = "required field is missing"
        else:
            msg = msg.replace("Input should be", "must be").replace("List should have", "must have")
        out.append(f"{where or '<root>'}: {msg}")
    return out
