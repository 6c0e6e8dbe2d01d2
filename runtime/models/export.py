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

POLICY_DIR = "policy"


class ExportError(ValueError):
    pass


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
        ckpt_dir = json.loads(summary.read_text()).get("checkpoint_dir")
        if ckpt_dir:
            found = list_checkpoints(ckpt_dir)
    found = [p for p in found if (p / POLICY_DIR).is_dir()]
    if not found:
        raise ExportError(f"{source}: no checkpoint with a policy/ folder here (expected a step-NNNNNN folder, a "
                          "folder of them, or a run folder whose summary.json names spec.checkpoint.path)")
    return found[-1]


def export_policy(source: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the checkpoint's policy to `out` as an HF folder (in `dtype` when given); returns `out`."""
    ckpt = find_checkpoint(source)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out}: output folder exists and is not empty")
    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt / POLICY_DIR, tmp)
    if dtype is not None:
        from transformers import AutoModelForCausalLM

        from .hub import parse_dtype

        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=parse_dtype(dtype, field="--dtype"))
        for f in tmp.glob("*.safetensors*"):
            f.unlink()
        model.save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def main(args: argparse.Namespace) -> int:
    try:
        out = export_policy(args.source, args.out, args.dtype)
    except (ExportError, ValueError) as exc:
        print(f"specrl export: {exc}", file=sys.stderr)
        return 1  # invalid input (see `specrl --help`)
    print(f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0
