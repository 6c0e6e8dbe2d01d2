"""Lockstep runs: several configurations decode side by side, one step each in turn, so that they share the
machine's minute.

On a shared CPU machine the same run repeated with the same seeds (the same texts, the same work) measured
312–475 tokens per CPU-second at batch 1 (coefficient of variation 18%), and at batch 16 1,452–2,323 (20%):
the machine's speed drifts over seconds, and a configuration timed for the few seconds it runs alone carries
the speed of those seconds. Each configuration then needs many repeats before a few percent between two of them
means anything. In lockstep every configuration runs one decode step, then the next one does, round the ring:
a drift slower than a few steps (tens of milliseconds) reaches all of them alike, and their ratio keeps only
what they do differently.

Each configuration runs its own engine on a thread of its own, but only the thread holding the turn runs: the
others wait on a condition (no CPU), so a step's CPU and wall time are its own. A thread keeps the turn from the
start of one decode step to the start of its next one (admissions and prefills included) and passes it on at
its `Timeline.decide`. What lockstep changes: every step starts after another engine's step streamed other
weights, so caches are as cold for each configuration as for the others (and colder than in a run alone).

How cold depends on who stepped just before: measured on an AMD EPYC Zen 5 (32 MiB L3) in the sweep's ring, a
second draft_model γ=6 placed after quantized_self ran at 0.958 / 0.979 / 0.994 of the γ=6 placed after
draft_model γ=4 at batch 1 / 2 / 4 (same texts, four repeats, every repeat below 1 at batch 1). A ring only
rotated between repeats keeps every member's predecessor, and the adaptive policy, last in the ring, stepped after
quantized_self in every repeat. `ring_order` changes the predecessors from one repeat to the next instead.
"""

from __future__ import annotations

import math
import threading
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
    """Turns for `n` members, one at a time in order; a member that leaves is skipped from then on."""

    def __init__(self, n: int) -> None:
        self._members = list(range(n))
        self._at = 0
        self._cond = threading.Condition()

    def wait(self, member: int) -> None:
        """Block until it is `member`'s turn."""
        with self._cond:
            self._cond.wait_for(lambda: self._members[self._at] == member)

    def pass_on(self, member: int) -> None:
        """`member` (whose turn it is) hands the turn to the next member and waits for its own next turn."""
        with self._cond:
            self._at = (self._at + 1) % len(self._members)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._members[self._at] == member)

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


def run_lockstep(jobs: Sequence[Callable[[Callable[[], None]], T]]) -> list[T]:
    """Run `jobs` in lockstep and return their results in order. Each job is called on a thread of its own with
    `turn`, a callable it must call at the start of every step (it returns when that job's turn has come round
    again); everything a job does between two calls runs while the others wait. An exception in a job is raised
    here once every job has ended."""
    ring = Ring(len(jobs))
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
