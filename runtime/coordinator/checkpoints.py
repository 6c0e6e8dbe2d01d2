"""Checkpoints: where they live, which one a restarted job resumes from, and how old ones are pruned.

A checkpoint is a folder `step-NNNNNN` under the spec's checkpoint directory (a mounted volume in a cluster);
it is complete once trainer rank 0 wrote `trainer.pt` (written atomically).
"""

from __future__ import annotations

import shutil
from pathlib import Path


def checkpoint_path(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after `step` steps."""
    return Path(root) / f"step-{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root` (folders `step-NNNNNN` holding trainer.pt), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / "trainer.pt").is_file())


def latest_checkpoint(root: str | Path | None) -> str | None:
    """The newest complete checkpoint under `root`: where a restarted job resumes."""
    found = list_checkpoints(root) if root else []
    return str(found[-1]) if found else None


def prune_checkpoints(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)


def save(trainer_actors: list, directory: str | Path, cursor: dict, keep: int) -> str:
    """Every trainer rank writes its part (rank 0: weights, optimizer, `cursor`); then older ones are pruned."""
    import ray

    ray.get([a.save_checkpoint.remote(str(directory), cursor) for a in trainer_actors])
    prune_checkpoints(Path(directory).parent, keep)
    return str(directory)


def load(trainer_actors: list, directory: str | Path) -> dict:
    """Every trainer rank loads its part; returns the coordinator's cursor saved with it."""
    import ray

    return ray.get([a.load_checkpoint.remote(str(directory)) for a in trainer_actors])[0]
