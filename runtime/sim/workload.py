"""Response lengths of RL steps: a long-tail distribution (lognormal, Pareto or empirical), growing over steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .scenario import Response, Workload

FIELD = "workload.response.metrics_file"


def empirical_lengths(resp: Response) -> list[int]:
    """The empirical lengths; ValueError naming workload.response.metrics_file when that file is unusable."""
    if resp.lengths:
        return list(resp.lengths)
    if resp.metrics_file:
        return metrics_file_lengths(resp.metrics_file)
    raise ValueError("workload.response: empirical needs lengths or metrics_file")


def metrics_file_lengths(path: str) -> list[int]:
    """Every `response_lengths` entry of a `specrl run` metrics.jsonl."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{FIELD}: cannot read {path!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{FIELD}: {path!r} is not UTF-8 text") from None
    out: list[int] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{FIELD}: {path}:{lineno}: not JSON ({exc.msg})") from None
        lengths = record.get("response_lengths", []) if isinstance(record, dict) else None
        if not isinstance(lengths, list) or not all(isinstance(x, int) and x >= 0 for x in lengths):
            raise ValueError(f"{FIELD}: {path}:{lineno}: response_lengths must be a list of integers >= 0")
        out.extend(lengths)
    if not out:
        raise ValueError(f"{FIELD}: {path}: no response_lengths in any line")
    return out


def step_lengths(w: Workload, step: int) -> np.ndarray:
    """Response lengths (tokens) of every sequence of RL step `step` (prompts x group), seeded per step."""
    rng = np.random.default_rng([w.seed, step])
    n = w.prompts_per_step * w.group_size
    r = w.response
    scale = (1.0 + w.length_growth_per_step) ** step
    if r.distribution == "lognormal":
        x = rng.lognormal(np.log(r.median * scale), r.sigma, n)
    elif r.distribution == "pareto":
        # median of a Pareto(xm, a) is xm * 2^(1/a): choose xm so the median matches
        xm = r.median * scale / 2 ** (1 / r.alpha)
        x = xm * (1 + rng.pareto(r.alpha, n))
    else:
        pool = np.asarray(empirical_lengths(r), dtype=float) * scale
        x = rng.permutation(pool) if r.exact else rng.choice(pool, n)
    return np.clip(np.rint(x), r.min, r.max).astype(np.int64)
