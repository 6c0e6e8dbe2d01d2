"""A rollout worker decodes its whole assignment as one continuously batched generate; the coordinator's long-tail
signal is the worker's own live count of sequences still decoding (`RolloutWorker.decoding`)."""

from __future__ import annotations

import pytest

from tests.integration.rlrun.micro import micro_settings

pytestmark = pytest.mark.integration


def test_decoding_follows_the_engine_batch_as_sequences_finish(micro) -> None:
    from specrl.runtime.rollout_worker import RolloutWorker

    s = micro_settings(rollouts=1, method="none", adaptive=False, prompts_per_step=6, group_size=4,
                       max_new_tokens=40)
    worker = RolloutWorker(s, "micro-rollout-0")
    assert worker.engine.max_batch_size == 24  # the whole step batch, not waves of 16
    engine = worker.engine
    seen: list[tuple[int, int]] = []
    progress: list[int] = []
    inner = engine.controller

    class Spy:  # asks the worker between decode steps, as the coordinator does from another actor thread
        def decide(self, active_batch_size: int):
            live = worker.decoding()
            seen.append((active_batch_size, live["sequences"]))
            progress.append(live["steps"])
            return inner.decide(active_batch_size)

        def observe(self, decision, record) -> None:
            inner.observe(decision, record)

    engine.controller = Spy()
    assert worker.decoding() == {"sequences": 0, "steps": 0}
    out = worker.generate([(f"s0-p{i}", i) for i in range(6)], step=0)
    assert worker.decoding() == {"sequences": 0, "steps": 0} and len(out["samples"]) == 24
    assert progress == list(range(len(progress)))  # one more decode step at every question
    assert seen[0] == (24, 24)  # before the first step: the whole assignment
    # afterwards: what the previous decode step ran, which only shrinks
    for (_, live), (previous_batch, _) in zip(seen[1:], seen):
        assert live == previous_batch
    assert [live for _, live in seen] == sorted((live for _, live in seen), reverse=True)
    assert seen[-1][1] < 24  # the batch shrank: some sequences finished before the last ones (the tail)
