"""What a user asks of the simulator: SD vs plain decoding, and the elastic policy vs the best static split."""

from __future__ import annotations

from dataclasses import dataclass

from .rl_sim import SimResult, simulate
from .scenario import Scenario


def without_speculation(s: Scenario) -> Scenario:
    return s.model_copy(update={"speculative": s.speculative.model_copy(update={"drafter": "none"})})


def split_variant(s: Scenario) -> Scenario:
    """The same job on a trainer/rollout split (what the operator manages); colocated jobs get a half split."""
    if s.placement == "split":
        return s
    return s.model_copy(update={"placement": "split", "trainer_gpus": s.cluster.gpus // 2})


def split_candidates(s: Scenario, points: int = 8) -> list[int]:
    """Trainer GPU counts to try: multiples of the rollout instance size, coarse on big pools."""
    tp, n = s.rollout.tensor_parallel, s.cluster.gpus
    valid = [t for t in range(tp, n - tp + 1, tp)] or [s.split_trainer_gpus]
    if len(valid) <= points:
        return valid
    stride = len(valid) / points
    return sorted({valid[int(i * stride)] for i in range(points)} | {valid[-1]})


def best_static(s: Scenario) -> tuple[int, SimResult]:
    """Search the trainer share that minimises total time (coarse grid, then the neighbours of the best)."""
    results: dict[int, SimResult] = {}

    def run(t: int) -> SimResult:
        if t not in results:
            results[t] = simulate(s, trainer_gpus=t, elastic=False)
        return results[t]

    grid = split_candidates(s)
    best = min(grid, key=lambda t: run(t).total_seconds)
    i = grid.index(best)
    lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    tp = s.rollout.tensor_parallel
    fine = list(range(lo, hi + 1, tp))
    if len(fine) > 6:
        fine = fine[:: max(1, len(fine) // 6)]
    for t in fine:
        run(t)
    best = min(results, key=lambda t: results[t].total_seconds)
    return best, results[best]


@dataclass
class Report:
    scenario: Scenario
    ar: SimResult
    sd: SimResult
    static_trainer_gpus: int
    static: SimResult
    configured: SimResult
    elastic: SimResult

    @property
    def rollout_speedup(self) -> float:
        return self.ar.rollout_seconds / self.sd.rollout_seconds

    @property
    def end_to_end_speedup(self) -> float:
        return self.ar.total_seconds / self.sd.total_seconds

    @property
    def elastic_vs_static_speedup(self) -> float:
        return self.static.total_seconds / self.elastic.total_seconds

    def to_json(self, preset: str | None) -> dict:
        def run(r: SimResult) -> dict:
            n = len(r.steps)
            return {
                "total_seconds": r.total_seconds,
                "rollout_seconds_per_step": r.rollout_seconds / n,
                "step_seconds": r.total_seconds / n,
                "train_seconds_per_step": r.train_seconds / n,
                "trainer_gpu_seconds": r.gpu_seconds("trainer"),
                "rollout_gpu_seconds": r.gpu_seconds("rollout"),
                "tail_idle_fraction": r.tail_idle_fraction(),
                "sd_share": sum(x.sd_share for x in r.steps) / n,
                "trainer_gpus_per_step": [x.trainer_gpus for x in r.steps],
                "moves": [m for x in r.steps for m in x.moves],
            }

        return {
            "preset": preset,
            "scenario": self.scenario.name,
            "rollout_speedup": self.rollout_speedup,
            "end_to_end_speedup": self.end_to_end_speedup,
            "elastic_vs_static_speedup": self.elastic_vs_static_speedup,
            "elastic_vs_configured_split_speedup": self.configured.total_seconds / self.elastic.total_seconds,
            "best_static_trainer_gpus": self.static_trainer_gpus,
            "expect": self.scenario.expect.model_dump(),
            "runs": {"ar": run(self.ar), "sd": run(self.sd), "static_split": run(self.static),
                     "configured_split": run(self.configured),
                     "elastic": run(self.elastic)},
        }


def evaluate(s: Scenario) -> Report:
    ar = simulate(without_speculation(s), elastic=False)
    sd = simulate(s, elastic=False)
    split = split_variant(s)
    t, static = best_static(split)
    # the elastic run starts from the configured split; the operator has to find the good split by itself
    configured = simulate(split, elastic=False)
    elastic = simulate(split, elastic=True)
    return Report(s, ar, sd, t, static, configured, elastic)
