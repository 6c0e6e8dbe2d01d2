"""Fluid discrete-event simulation of one RL step's rollout on a set of inference instances.

Each instance runs continuous batching: up to `max_batch` sequences decode together, queued sequences join as
others finish. Between two events (a sequence finishing, a chunk of iterations elapsing) the batch is constant,
so its time is computed in closed form instead of token by token: every active sequence advances by the same
expected number of tokens per iteration (1 for plain decoding, L(alpha, gamma) with speculation). Events are
kept in a heap keyed by the progress at which each sequence finishes, so a step costs O(N log N) for N sequences.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .cost_model import CostModel
from .speculation import SpeculationPolicy

CHUNK_TOKENS = 512  # re-evaluate costs (KV grows) and the SD decision at least this often


@dataclass
class Segment:
    start: float
    end: float
    batch: int
    gamma: int


@dataclass
class InstanceRun:
    finish: float = 0.0
    segments: list[Segment] = field(default_factory=list)
    admit_times: list[float] = field(default_factory=list)
    finish_times: list[float] = field(default_factory=list)
    sd_seconds: float = 0.0
    iterations: float = 0.0
    target_forwards: float = 0.0


def simulate_instance(lengths: list[int], prompt_tokens: int, max_batch: int, costs: CostModel,
                      policy: SpeculationPolicy, alpha: float, start: float = 0.0) -> InstanceRun:
    run = InstanceRun(finish=start)
    queue = deque(int(x) for x in lengths)
    heap: list[tuple[float, float]] = []  # (progress at which it finishes, progress at which it joined)
    t, progress, joined_sum, batch = start, 0.0, 0.0, 0
    while queue or heap:
        n = min(max_batch - batch, len(queue))
        if n:
            for _ in range(n):
                heapq.heappush(heap, (progress + queue.popleft(), progress))
                run.admit_times.append(t)
            joined_sum += progress * n
            batch += n
            t += costs.prefill(n, prompt_tokens)
        ctx_sum = batch * (prompt_tokens + progress) - joined_sum
        choice = policy.choose(batch, ctx_sum, alpha)
        advance = min(heap[0][0] - progress, CHUNK_TOKENS)
        iters = advance / choice.tokens_per_iter
        seconds = iters * choice.seconds_per_iter
        run.segments.append(Segment(t, t + seconds, batch, choice.gamma))
        run.iterations += iters
        run.target_forwards += iters
        if choice.gamma:
            run.sd_seconds += seconds
        t += seconds
        progress += advance
        while heap and heap[0][0] <= progress + 1e-9:
            _, joined = heapq.heappop(heap)
            joined_sum -= joined
            batch -= 1
            run.finish_times.append(t)
    run.finish = t
    return run


@dataclass
class RolloutPhase:
    duration: float
    runs: list[InstanceRun]
    tp: int
    sequences: int
    tokens: int
    long_tail_seconds: float
    idle_gpu_seconds: float
    sd_share: float

    def status_at(self, t: float) -> tuple[int, int]:
        """(queue depth, active sequences) at time t since the phase started, as a coordinator would report."""
        if not hasattr(self, "_admits"):
            self._admits = np.sort(np.concatenate([r.admit_times for r in self.runs]))
            self._finishes = np.sort(np.concatenate([r.finish_times for r in self.runs]))
        admitted = int(np.searchsorted(self._admits, t, side="right"))
        finished = int(np.searchsorted(self._finishes, t, side="right"))
        return self.sequences - admitted, admitted - finished


def simulate_rollout(lengths: np.ndarray, instances: int, tp: int, prompt_tokens: int, max_batch: int,
                     costs: CostModel, policy: SpeculationPolicy, alpha: float, long_tail_fraction: float,
                     seed: int = 0) -> RolloutPhase:
    """Round-robin the step's sequences over `instances` (as a data-parallel router balances request counts)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    shards = [lengths[order[i::instances]].tolist() for i in range(instances)]
    runs = [simulate_instance(sh, prompt_tokens, max_batch, costs, policy, alpha) for sh in shards]
    duration = max(r.finish for r in runs)
    finishes = np.sort(np.concatenate([r.finish_times for r in runs]))
    n = len(finishes)
    # the long tail starts when at most long_tail_fraction of the step's sequences are still running
    k = max(0, min(n - 1, int(np.ceil(n * (1.0 - long_tail_fraction))) - 1))
    tail = duration - float(finishes[k]) if n else 0.0
    idle = sum((duration - r.finish) * tp for r in runs)
    busy = sum(r.finish for r in runs)
    sd = sum(r.sd_seconds for r in runs)
    return RolloutPhase(duration, runs, tp, n, int(lengths.sum()), tail, idle, sd / busy if busy else 0.0)
