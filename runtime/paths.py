"""Where specrl keeps things it builds once and reuses (built-in models, drafters, calibration data)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "SPECRL_CACHE_DIR"


def file_in_the_way(folder: Path) -> Path | None:
    """The existing file (not a folder) at `folder` or above it that keeps `folder` from being created and
    written, if any: what an output folder is checked for before any work."""
    for path in (folder, *folder.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def cache_dir(*parts: str, create: bool = True) -> Path:
    """`$SPECRL_CACHE_DIR` or `~/.cache/specrl`, optionally joined with `parts`; created unless `create=False`.

    Independent of the working directory and of the repository checkout, so a pod, a test and `specrl run`
    all find the same cache.
    """
    root = os.environ.get(ENV_VAR) or str(Path.home() / ".cache" / "specrl")
    path = Path(root).expanduser().joinpath(*parts)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path
