"""Lockstep runs: several configurations decode side by side, a slice of steps each in turn, so that they share
the machine's minute.

On a shared CPU machine the same run repeated with the same seeds (the same texts, the same work) measured
312–475 tokens per CPU-second at batch 1 (coefficient of variation 18%), and at batch 16 1,452–2,323 (20%):
the machine's speed drifts over seconds, and a configuration timed for the few seconds it runs alone carries
the speed of those seconds. Each configuration then needs many repeats before a few percent between two of them
means anything. In lockstep every configuration runs its decode steps for a slice of `slice_s` seconds, then the
next one does, round the ring: a drift slower than a turn of the ring reaches all of them alike, and their ratio
keeps only what they do differently.

Each configuration runs its own engine on a thread of its own, but only the thread holding the turn runs: the
others wait on a condition (no CPU), so a step's CPU and wall time are its own. A thread keeps the turn from the
start of one decode step to the start of the first step after its slice is spent (admissions and prefills
included) and passes it on there (its `Timeline.decide`).

**Why slices, not one step each** (the eighteenth to twenty-eighth sessions' benchmark passed the turn at every
step). A step that starts after another engine's step finds the caches holding that engine's weights and KV
cache, not its own, and that costs plain decoding more than speculation: measured on an AMD EPYC Zen 5 (32 MiB
L3, 28 GB/s), the bench models, five or six fixed configurations, three or four repeats each, two runs:

| draft_model γ=2 vs plain decoding | alone, interleaved | one step each | 10 ms slices | 30 ms | 50 ms | 100 ms |
|---|---|---|---|---|---|---|
| batch 8 (rates of the steps at 8) | 0.96 | 1.14 | 1.09 | 1.03 | | |
| the long-tail workload | 1.10, 1.15 | 1.17, 1.21 | | 1.14 | 1.09 | 1.09 |

Turning at every step, the benchmark priced speculation up to a fifth above its rate in an engine decoding alone,
which is how a rollout worker decodes. With 50 ms slices a slice's first step is the only cold one, the ratios
come near what runs alone measured (the whole workload at 1.09, against 1.10 and 1.15 alone and 1.17 and 1.21 at
one step each; slightly below alone, within the runs' spread), and the ring still turns in well under a second; the same configuration twice in the ring
(the same texts) read 0.976–1.032 of itself over four repeats (one step each: 0.971–1.096; alone: 0.996–1.131).

How cold a slice's first step is depends on who stepped just before: measured on the same machine kind with a
turn at every step, a second draft_model γ=6 placed after quantized_self ran at 0.958 / 0.979 / 0.994 of the γ=6
placed after draft_model γ=4 at batch 1 / 2 / 4 (same texts, four repeats, every repeat below 1 at batch 1). A
ring only rotated between repeats keeps every member's predecessor, and the adaptive policy, last in the ring,
stepped after quantized_self in every repeat. `ring_order` changes the predecessors from one repeat to the next
instead.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def ring_order(names: Sequence[str], repeat: int) -> list[str]:
    """The ring for this repeat: `names` walked with a stride coprime to their number, a different stride each
    repeat (cycling), starting at `repeat`. Member j's predecessor is the member `stride` places before it, so over
    the coprime strides of n members every member follows as many different others (n − 1 of them when n is prime:
    the sweep's seven configurations follow each of the others once in six repeats)."""
    n = len(names)
    strides = [s for s in range(1, n) if math.gcd(s, n) == 1] or [1]
    stride = strides[repeat % len(strides)]
    return [names[(repeat + i * stride) % n] for i in range(n)]


class Ring:
    """Turns for `n` members, one at a time in order, each kept for at least `slice_s` seconds of `clock`; a member
    that leaves is skipped from then on."""

    def __init__(self, n: int, slice_s: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> None:
        if not slice_s >= 0:
            raise ValueError(f"slice_s: must be >= 0, got {slice_s!r}")
        self._members = list(range(n))
        self._at = 0
        self._cond = threading.Condition()
        self.slice_s = slice_s
        self._clock = clock
        self._since = 0.0  # when the member holding the turn got it (only that member reads or writes it)

    def wait(self, member: int) -> None:
        """Block until it is `member`'s turn."""
        with self._cond:
            self._cond.wait_for(lambda: self._members[self._at] == member)
        self._since = self._clock()

    def pass_on(self, member: int) -> None:
        """`member` (whose turn it is) hands the turn to the next member once its slice is spent, and waits for its
        own next turn; before that it keeps the turn (returns at once)."""
        if self.slice_s and self._clock() - self._since < self.slice_s:
            return
        with self._cond:
            self._at = (self._at + 1) % len(self._members)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._members[self._at] == member)
        self._since = self._clock()

    def leave(self, member: int) -> None:
        """`member` is done (it holds the turn): the next member's turn, and `member` is skipped from now on."""
        with self._cond:
            k = self._members.index(member)
            self._members.pop(k)
            if self._members:
                if k < self._at:
                    self._at -= 1
                self._at %= len(self._members)
            self._cond.notify_all()


def run_lockstep(jobs: Sequence[Callable[[Callable[[], None]], T]], slice_s: float = 0.0) -> list[T]:
    """Run `jobs` in lockstep and return their results in order. Each job is called on a thread of its own with
    `turn`, a callable it must call at the start of every step (it returns at once while the job's slice of
    `slice_s` seconds lasts, else when its turn has come round again); everything a job does between two calls
    runs while the others wait. An exception in a job is raised here once every job has ended."""
    ring = Ring(len(jobs), slice_s)
    results: list[T | None] = [None] * len(jobs)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        ring.wait(i)
        try:
            results[i] = jobs[i](lambda: ring.pass_on(i))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            errors.append(exc)
        finally:
            ring.leave(i)

    threads = [threading.Thread(target=work, args=(i,), name=f"lockstep-{i}", daemon=True)
               for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]
