"""Response lengths of RL steps: a long-tail distribution (lognormal, Pareto or empirical), growing over steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .scenario import Response, Workload


def empirical_lengths(resp: Response) -> list[int]:
    if resp.lengths:
        return list(resp.lengths)
    if resp.metrics_file:
        out: list[int] = []
        for line in Path(resp.metrics_file).read_text().splitlines():
            if line.strip():
                out.extend(int(x) for x in json.loads(line).get("response_lengths", []))
        if not out:
            raise ValueError(f"{resp.metrics_file}: no response_lengths in any line")
        return out
    raise ValueError("workload.response: empirical needs lengths or metrics_file")


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
