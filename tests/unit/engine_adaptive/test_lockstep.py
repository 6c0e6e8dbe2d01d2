"""Lockstep runs (`runtime/bench/lockstep.py`): one step (or a slice of steps) each in turn, only one running at a
time, each run's time its own."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from specrl.runtime.bench.lockstep import Ring, ring_order, run_lockstep


def _stepper(steps: int, log: list[tuple[int, int]], name: int, running: list[int],
             work: Callable[[], None] = lambda: None) -> Callable[[Callable[[], None]], int]:
    def job(turn: Callable[[], None]) -> int:
        for k in range(steps):
            turn()
            running[0] += 1
            log.append((name, k))
            assert running[0] == 1, "two jobs ran at once"
            work()
            running[0] -= 1
        return name * 100 + steps

    return job


def test_jobs_take_one_step_each_in_turn_and_the_ring_closes_over_those_that_end() -> None:
    log: list[tuple[int, int]] = []
    running = [0]
    results = run_lockstep([_stepper(n, log, i, running, lambda: time.sleep(0.001))
                            for i, n in enumerate((3, 1, 4))])
    assert results == [3, 101, 204]
    assert log == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2), (2, 2), (2, 3)]


def test_only_the_job_holding_the_turn_runs() -> None:
    # busy work between turns: with two cores and no ring, the jobs would overlap
    log: list[tuple[int, int]] = []
    running = [0]

    def spin() -> None:
        end = time.perf_counter() + 0.002
        while time.perf_counter() < end:
            pass

    run_lockstep([_stepper(20, log, i, running, spin) for i in range(3)])
    assert [name for name, _ in log] == [0, 1, 2] * 20


def test_an_error_in_one_job_is_raised_once_the_others_have_ended() -> None:
    done: list[int] = []

    def failing(turn: Callable[[], None]) -> None:
        turn()
        raise RuntimeError("step 1 failed")

    def fine(turn: Callable[[], None]) -> None:
        for _ in range(5):
            turn()
        done.append(1)

    with pytest.raises(RuntimeError, match="step 1 failed"):
        run_lockstep([failing, fine])
    assert done == [1]  # the other job was not left waiting for a turn that never came


def test_ring_skips_a_member_that_left() -> None:
    ring = Ring(3)
    order: list[int] = []

    def member(i: int, turns: int) -> None:
        ring.wait(i)
        for _ in range(turns):
            order.append(i)
            ring.pass_on(i)
        order.append(i)
        ring.leave(i)

    threads = [threading.Thread(target=member, args=(i, t)) for i, t in enumerate((2, 0, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert order == [0, 1, 2, 0, 2, 0, 2]


def test_a_member_keeps_the_turn_until_its_slice_is_spent() -> None:
    # a clock that only the member holding the turn moves, one unit a step: slices of 3 units are 3 steps
    now = [0.0]
    ring = Ring(2, slice_s=3.0, clock=lambda: now[0])
    order: list[int] = []

    def member(i: int, steps: int) -> None:
        ring.wait(i)
        for _ in range(steps):
            order.append(i)
            now[0] += 1.0
            ring.pass_on(i)
        ring.leave(i)

    threads = [threading.Thread(target=member, args=(i, n)) for i, n in enumerate((7, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert order == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0]


def test_jobs_whose_slice_outlasts_them_run_one_after_another() -> None:
    log: list[tuple[int, int]] = []
    running = [0]
    run_lockstep([_stepper(n, log, i, running) for i, n in enumerate((3, 2, 4))], slice_s=600.0)
    assert log == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (2, 3)]
    with pytest.raises(ValueError, match="slice_s"):
        Ring(2, slice_s=-1.0)


def test_runs_in_lockstep_decode_what_they_decode_alone_and_time_only_their_own_steps() -> None:
    import torch
    from specrl.runtime.bench.rollout import run_engine, side_by_side
    from specrl.runtime.engine import RolloutEngine, SamplingParams
    from specrl.runtime.engine.control import FixedController
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2)).eval()
    engines = {name: RolloutEngine(model, max_batch_size=4, dtype="float32", seed=0) for name in ("a", "b")}
    prompts = [[1, 2, 3]] * 8
    params = [SamplingParams(temperature=1.0, max_new_tokens=4 + 3 * i, seed=i) for i in range(8)]
    alone = run_engine(engines["a"], FixedController(None), prompts, params, max_batch=4)

    wall, cpu = time.perf_counter(), time.process_time()
    both = side_by_side(engines, {"a": FixedController(None), "b": FixedController(None)}, prompts, params,
                        max_batch=4)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    for x in both.values():
        assert x.lengths == alone.lengths  # same seeds, same texts: lockstep changes the timing only
        assert {b: row[0] for b, row in x.by_batch.items()} == {b: row[0] for b, row in alone.by_batch.items()}
    # each run's clocks leave out the other's turns: together they fit in what the pair took
    assert sum(x.seconds for x in both.values()) <= wall * 1.05
    assert sum(x.cpu_seconds for x in both.values()) <= cpu * 1.05 + 1e-3
    assert all(sum(row[2] for row in x.by_batch.values()) <= x.seconds for x in both.values())


def test_the_ring_changes_every_members_predecessor_from_one_repeat_to_the_next() -> None:
    # A ring only rotated keeps who steps before whom, and a member's rate depends on it (caches): the sweep's seven
    # configurations must each follow all six others once over six repeats.
    names = ["ar", "g2", "g4", "g6", "ngram", "qs", "adaptive"]
    predecessors: dict[str, list[str]] = {n: [] for n in names}
    for repeat in range(6):
        order = ring_order(names, repeat)
        assert sorted(order) == sorted(names)
        for i, n in enumerate(order):
            predecessors[n].append(order[i - 1])
    assert all(sorted(p) == sorted(set(names) - {n}) for n, p in predecessors.items()), predecessors
    # any size: a permutation, and distinct predecessors across the strides coprime to it
    for size in range(1, 11):
        members = [str(i) for i in range(size)]
        orders = [ring_order(members, r) for r in range(4)]
        assert all(sorted(o) == members for o in orders)
    ten = [str(i) for i in range(10)]  # strides 1, 3, 7, 9
    before = [{o[i]: o[i - 1] for i in range(10)}["0"] for o in (ring_order(ten, r) for r in range(4))]
    assert len(set(before)) == 4
