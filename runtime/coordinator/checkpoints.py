"""Checkpoints: where they live, which one a restarted job resumes from, and how old ones are pruned.

A checkpoint is a folder `step-NNNNNN` under the spec's checkpoint directory (`spec.checkpoint.path`, a mounted
volume in a cluster). Every trainer rank writes its part into it (the format is the trainer's business:
`TrainerWorker.save_checkpoint`/`load_checkpoint`, called only from `save`/`load` below); once all ranks are done
the marker file `COMPLETE` is written atomically. Only folders with the marker count: a job killed mid-save
resumes from the previous one.

The coordinator pod need not mount the volume: every file-system step (marker, discovery, pruning) runs in trainer
rank 0's process, where the volume is mounted. With several trainer pods the volume must be shared by them
(ReadWriteMany), or all trainers must run on one node.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

MARKER = "COMPLETE"


def checkpoint_path(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after `step` steps."""
    return Path(root) / f"step-{step:06d}"


def checkpoint_version(directory: str | Path) -> int:
    """The weight version a checkpoint folder holds (`step-NNNNNN`: taken after NNNNNN steps)."""
    return int(Path(directory).name.removeprefix("step-"))


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root` (folders `step-NNNNNN` holding the marker), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / MARKER).is_file())


def mark_complete(directory: str | Path, info: dict) -> None:
    """Write the marker (atomically: a reader sees all of it or nothing)."""
    d = Path(directory)
    tmp = d / f".{MARKER}.tmp"
    tmp.write_text(json.dumps({**info, "time": time.time()}) + "\n")
    os.replace(tmp, d / MARKER)


def latest_checkpoint(root: str | Path | None) -> str | None:
    """The newest complete checkpoint under `root`: where a restarted job resumes."""
    found = list_checkpoints(root) if root else []
    return str(found[-1]) if found else None


def prune_checkpoints(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)


def save(trainer_actors: list, directory: str | Path, cursor: dict, keep: int) -> str:
    """Every trainer rank writes its part (rank 0: weights, optimizer, `cursor`); then the marker, then older
    checkpoints are pruned."""
    import ray

    ray.get([a.save_checkpoint.remote(str(directory), cursor) for a in trainer_actors])
    info = {"step": cursor["step"], "weight_version": cursor["weight_version"], "trainers": len(trainer_actors)}
    ray.get(trainer_actors[0].__ray_call__.remote(_finish_on_trainer, str(directory), info, keep))
    return str(directory)


def _finish_on_trainer(_trainer: object, directory: str, info: dict, keep: int) -> None:
    mark_complete(directory, info)
    prune_checkpoints(Path(directory).parent, keep)


def find_latest(trainer_actor: Any, root: str | None) -> str | None:
    """The newest complete checkpoint under `root`, as trainer rank 0 (which mounts the volume) sees it."""
    import ray

    if not root:
        return None
    return ray.get(trainer_actor.__ray_call__.remote(lambda _trainer, r: latest_checkpoint(r), root))


def load(trainer_actors: list, directory: str | Path) -> dict:
    """Every trainer rank loads its part; returns the coordinator's cursor saved with it."""
    import ray

    return ray.get([a.load_checkpoint.remote(str(directory)) for a in trainer_actors])[0]
