"""Runtime faults injected into real jobs (local Ray, real actors, gloo): issue 13, items 12-18.

Every test counts prompt draws end to end: each draw is trained exactly once or dropped with a counted reason.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from specrl.runtime.coordinator import JobCoordinator

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _counter(coord: JobCoordinator, name: str) -> float:
    body = coord.metrics()[0].decode()
    line = next(x for x in body.splitlines() if x.startswith(name + "{") and 'role="coordinator"' in x)
    return float(line.rsplit(" ", 1)[1])


def _pid(actor) -> int:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()))


def test_task_error_hung_worker_and_slow_reward(local_ray, micro, tmp_path):
    """Three faults in one job (3 rollout workers, 9 prompts drawn once each):
    - a prompt too long for the policy's context makes `generate` raise (a task error, the worker lives): it is
      retried alone once, then dropped with its reason; no worker retires for it;
    - a worker frozen with SIGSTOP while it holds a chunk (hung) is retired after rolloutChunkTimeoutSeconds and
      its prompts run elsewhere;
    - a reward that sleeps past reward.timeoutSeconds scores 0 and is counted, the rollout goes on."""
    from micro import micro_settings
    from specrl.runtime.rl.task import SyntheticTask

    rows = [{"prompt": p.prompt, "answer": p.answer} for p in SyntheticTask(9, None, 3)]
    rows[2] = {"prompt": "x" * 300, "answer": "1"}  # longer than the micro policy's 256 positions
    rows[5] = {"prompt": "SLOW " + rows[5]["prompt"], "answer": rows[5]["answer"]}
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + [rows[0]]))  # the last line is held out
    s = micro_settings(steps=3, rollouts=3, prompts_per_step=3, dataset=str(data), eval_size=1,
                       reward="rewards_for_tests:slow_on_marker", drafter_training=False, prompt_retries=1,
                       reward_timeout_s=0.5, chunk_timeout_s=15.0, max_new_tokens=48)
    coord = JobCoordinator(s)
    frozen: list[int] = []
    try:
        coord.start()
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("h", coord.run()), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while not frozen and time.monotonic() < deadline and t.is_alive():
            with coord.lock:
                held = [(c.worker, [it.index for it in c.items]) for c in coord.pool.in_flight.values()]
            for worker, idx in held:
                if 2 not in idx and worker in coord.rollouts:
                    pid = _pid_or_none(coord.rollouts[worker])
                    if pid is not None:
                        os.kill(pid, signal.SIGSTOP)
                        frozen.append(pid)
                        frozen_worker = worker
                        break
            time.sleep(0.01)
        t.join(240)
        assert not t.is_alive(), "job did not finish"
        assert frozen, "could not catch a worker holding a chunk"
        history = box["h"]
        assert len(history) == 3
        rep = coord.ledger_report()
        assert rep["lost"] == 0 and rep["issued"] == 9
        assert rep["dropped"] == 1 and rep["trained"] == 8 and len(set(rep["trained_ids"])) == 8
        (pid, reason), = coord.ledger.dropped.items()
        assert "ValueError" in reason and coord.ledger.failures[pid] == 2
        states = {w["name"]: w["state"] for w in coord.status()["workers"] if w["role"] == "rollout"}
        assert states[frozen_worker] == "retired"
        assert sorted(states.values()) == ["active", "active", "retired"], states  # the task error retired no one
        assert _counter(coord, "specrl_rollout_task_errors_total") == 2
        assert _counter(coord, "specrl_rollout_prompts_dropped_total") == 1
        assert _counter(coord, "specrl_rollout_chunk_timeouts_total") == 1
        assert _counter(coord, "specrl_reward_timeouts_total") == s.group_size
        assert history[-1]["dropped"] == 1
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        coord.shutdown()


def _pid_or_none(actor) -> int | None:
    """The actor's process id, asked on its own thread pool (a busy rollout actor answers: max_concurrency 4)."""
    try:
        return _pid(actor)
    except Exception:  # noqa: BLE001 - it may have been retired meanwhile
        return None
