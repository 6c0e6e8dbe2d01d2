"""`specrl export RUN_OR_CHECKPOINT OUT_DIR`: the trained policy as a plain Hugging Face folder.

A checkpoint (`step-NNNNNN/` with `policy/` and `trainer.pt`) already holds the policy as safetensors + config +
tokenizer; export copies that folder (optionally cast to another dtype), checks that `transformers` loads it, and
leaves out the training state. The source may be a checkpoint, a folder of checkpoints (the newest complete one
is taken), or a run folder whose `summary.json` names the checkpoint folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

POLICY_DIR = "policy"


class ExportError(ValueError):
    pass


class RunSummary(BaseModel):
    """The part of a run's summary.json that export reads (`specrl run` writes many more keys)."""

    model_config = ConfigDict(extra="ignore")

    checkpoint_dir: str | None = Field(None, description="spec.checkpoint.path of the run")


def summary_checkpoint_dir(summary: Path) -> str | None:
    """checkpoint_dir of a run's summary.json; ExportError naming the file when it is not one."""
    try:
        data = json.loads(summary.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ExportError(f"{summary}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ExportError(f"{summary}: not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ExportError(f"{summary}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{summary}: expected a JSON object (a run's summary), got {type(data).__name__}")
    try:
        return RunSummary.model_validate(data).checkpoint_dir
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise ExportError(f"{summary}: checkpoint_dir: {err['msg'].replace('Input should be', 'must be')}") from None


def out_problem(out: Path) -> str | None:
    """Why OUT_DIR cannot be written, checked before any copy: it, or a folder above it, is a file, or it holds
    something already (export never overwrites)."""
    from ..paths import file_in_the_way

    if (blocker := file_in_the_way(out)) is not None:
        return f"{out}: exists and is not a directory" if blocker == out else f"{out}: {blocker} is not a directory"
    if out.exists() and any(out.iterdir()):
        return f"{out}: output folder exists and is not empty"
    return None


def find_checkpoint(source: str | Path) -> Path:
    """The checkpoint folder `source` names (see the module docstring)."""
    from ..coordinator import list_checkpoints

    src = Path(source)
    if not src.exists():
        raise ExportError(f"{source}: no such file or folder")
    if (src / "trainer.pt").is_file() and (src / POLICY_DIR).is_dir():
        return src
    found = list_checkpoints(src)
    summary = src / "summary.json"
    if not found and summary.is_file():
        ckpt_dir = summary_checkpoint_dir(summary)
        if ckpt_dir:
            found = list_checkpoints(ckpt_dir)
    found = [p for p in found if (p / POLICY_DIR).is_dir()]
    if not found:
        raise ExportError(f"{source}: no checkpoint with a policy/ folder here (expected a step-NNNNNN folder, a "
                          "folder of them, or a run folder whose summary.json names spec.checkpoint.path)")
    return found[-1]


def export_policy(source: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the checkpoint's policy to `out` as an HF folder (in `dtype` when given); returns `out`."""
    out = Path(out)
    if problem := out_problem(out):
        raise ExportError(problem)
    ckpt = find_checkpoint(source)
    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(ckpt / POLICY_DIR, tmp)
        if dtype is not None:
            _cast(tmp, dtype, ckpt / POLICY_DIR)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed export leaves nothing behind
        raise
    return out


def _cast(tmp: Path, dtype: str, policy: Path) -> None:
    """Rewrite the weights in `tmp` (a copy of `policy`) as `dtype`."""
    from transformers import AutoModelForCausalLM

    from .hub import parse_dtype

    try:
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=parse_dtype(dtype, field="--dtype"))
    except (OSError, ValueError) as exc:
        # transformers names the folder it read: the temporary copy, which is gone once this fails
        reason = str(exc).replace(str(tmp), str(policy)).splitlines()[0]
        raise ExportError(f"{policy}: cannot load the policy to cast it to {dtype}: {reason}") from None
    for f in tmp.glob("*.safetensors*"):
        f.unlink()
    model.save_pretrained(tmp)


def main(args: argparse.Namespace) -> int:
    try:
        out = export_policy(args.source, args.out, args.dtype)
    except (ExportError, ValueError) as exc:
        print(f"specrl export: {exc}", file=sys.stderr)
        return 1  # invalid input (see `specrl --help`)
    except OSError as exc:  # copying or writing: a full disk, a permission
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"specrl export: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0
