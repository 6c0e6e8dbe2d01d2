"""Real multi-actor RL jobs on local Ray with gloo weight sync: sync and async mode, drain, crash-resume, HTTP."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from specrl.runtime.coordinator import JobCoordinator
from specrl.runtime.coordinator_http import STATUS_KEYS
from specrl.runtime.metrics import METRIC_NAMES
from specrl.runtime.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run_in_thread(fn):
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def _finish(t, box, timeout=240):
    t.join(timeout)
    assert not t.is_alive(), "job did not finish in time"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _assert_ledger_clean(coord, steps, prompts_per_step):
    rep = coord.ledger_report()
    assert rep["lost"] == 0
    assert rep["issued"] == rep["trained"] == steps * prompts_per_step
    assert len(rep["trained_ids"]) == len(set(rep["trained_ids"])) == steps * prompts_per_step
    assert rep["queued"] == rep["in_flight"] == rep["completed"] == 0


def test_sync_job_http_and_elastic_trainers(local_ray, micro):
    """2 trainers (gloo DP) + 2 rollout workers; HTTP contract while it runs; a trainer drained over HTTP and a
    new trainer joining, each at a step boundary, with the data-parallel ranks bit-identical afterwards."""
    import ray
    import torch

    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=4, trainers=2, rollouts=2, reward="rewards_for_tests:length_reward")
    coord = JobCoordinator(s, token="s3cret", http_port=free_port())
    try:
        coord.start()
        before = coord.trainer_digest()
        url = coord.url
        assert url is not None  # start() binds the HTTP server
        t, box = _run_in_thread(coord.run_step)
        seen_phases = set()
        with httpx.Client(base_url=url, timeout=10) as http:
            while t.is_alive():
                st = http.get("/status").json()
                seen_phases.add(st["phase"])
                assert set(STATUS_KEYS) <= set(st)
                time.sleep(0.02)
            _finish(t, box)
            assert {"Rollout", "LongTail", "Training", "Syncing"} & seen_phases
            st = http.get("/status").json()
            assert st["step"] == 1 and st["weightVersion"] == 1 and st["complete"] is False
            assert st["stepBatchSize"] == s.prompts_per_step * s.group_size
            assert isinstance(st["tokensPerSecond"], float) and st["acceptanceLength"] is not None
            # the operator balances roles on where the last step's time went
            timing = st["lastStep"]
            assert timing["rolloutSeconds"] > 0 and timing["trainSeconds"] > 0
            assert 0 <= timing["longTailSeconds"] <= timing["rolloutSeconds"]
            from specrl.operator.rebalance import Signals

            assert Signals.from_status(st).last_step is not None
            names = {w["name"]: w for w in st["workers"]}
            assert set(names) == {"micro-trainer-0", "micro-trainer-1", "micro-rollout-0", "micro-rollout-1"}
            assert {w["role"] for w in st["workers"]} == {"trainer", "rollout"}
            assert http.get("/healthz").text == "ok"
            # drain: auth, unknown worker, bad body, accepted
            assert http.post("/drain", json={"worker": "micro-trainer-1"}).status_code == 401
            assert http.post("/drain", json={"worker": "micro-trainer-1"},
                             headers={"Authorization": "Bearer wrong"}).status_code == 401
            auth = {"Authorization": "Bearer s3cret"}
            assert http.post("/drain", json={"worker": "nope"}, headers=auth).status_code == 404
            assert http.post("/drain", json={}, headers=auth).status_code == 400
            r = http.post("/drain", json={"worker": "micro-trainer-1"}, headers=auth)
            assert r.status_code == 202 and r.json() == {"worker": "micro-trainer-1", "state": "draining"}
            r = http.post("/drain", json={"worker": "micro-trainer-0"}, headers=auth)  # the job's last trainer
            assert r.status_code == 409 and "last active trainer" in r.json()["error"]
            m = http.get("/metrics")
            assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
            exposed = {line.split("{")[0].split(" ")[0] for line in m.text.splitlines()
                       if line and not line.startswith("#")}
            exposed = {n for n in exposed if not n.endswith("_created")}  # prometheus_client's own series
            for name in ("specrl_rollout_queue_depth", "specrl_rollout_generated_tokens_total",
                         "specrl_spec_decode_num_drafts_total", "specrl_spec_decode_num_accepted_tokens_total",
                         "specrl_trainer_step", "specrl_weight_sync_duration_seconds_count",
                         "specrl_weight_sync_bytes_total", "specrl_weight_version", "specrl_drafter_train_steps_total"):
                assert name in exposed, name
            assert exposed <= METRIC_NAMES
            assert 'worker="micro-rollout-0"' in m.text and 'role="trainer"' in m.text

            coord.run_step()  # the drained trainer retires at this step's boundary
            states = {w["name"]: w["state"] for w in http.get("/status").json()["workers"]}
            assert states["micro-trainer-1"] == "retired" and list(coord.trainers) == ["micro-trainer-0"]
            coord.add_trainer_worker("micro-trainer-2")
            coord.run_step()  # ... and the new one joins at this one
            assert list(coord.trainers) == ["micro-trainer-0", "micro-trainer-2"]
            coord.run_step()  # a step with the new data-parallel group
            # TLT on idle rollout capacity: with every rollout worker idle, a round goes to one of them on a lent
            # copy of the drafter master copy, which comes back trained to trainer rank 0. (Inside a step the
            # tail can begin while both workers still decode their last chunk; trainer rank 0 then trains it.)
            first = coord.trainers["micro-trainer-0"]
            lent = ray.get(first.drafter_state.remote())
            coord.drafter.start(coord.last_samples, deadline_s=2.0)
            round_ = coord.drafter.finish()
            assert round_["where"].startswith("micro-rollout-") and round_["steps"] > 0, round_
            back = ray.get(first.drafter_state.remote())
            assert back["steps_total"] == lent["steps_total"] + round_["steps"]
            assert any(not torch.equal(back["model"][k], v) for k, v in lent["model"].items())
            coord.finish()
            st = http.get("/status").json()
            assert st["complete"] is True and st["phase"] == "Complete" and st["weightVersion"] == 4
        history = coord.get_history()
        assert [h["weight_version"] for h in history] == [1, 2, 3, 4]
        assert all(h["sync_bytes"] > 0 for h in history)
        # TLT: the drafter trained in the steps' long tails, on workers of the job
        assert sum(h["drafter_steps"] for h in history) > 0
        assert {h["drafter_where"] for h in history} - {None} <= {"micro-trainer-0", "micro-rollout-0",
                                                                  "micro-rollout-1"}, history
        _assert_ledger_clean(coord, 4, s.prompts_per_step)
        # data parallel: both ranks hold bit-identical weights, and they moved
        digests = ray.get([a.digest.remote() for a in coord.trainers.values()])
        assert digests[0] == digests[1] != before
    finally:
        coord.shutdown()


def test_grpo_raises_the_reward_of_a_real_job(local_ray, micro):
    """The whole loop learns: rollouts, rewards, advantages, GRPO updates and weight sync, over real actors.

    The reward is one the near-random micro policy earns about half the time (start the answer with a digit),
    so a sign error, a stale sync or an advantage bug anywhere shows up as a flat or falling reward.
    """
    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=20, prompts_per_step=8, group_size=4, lr=1e-2, reward="rewards_for_tests:starts_with_digit",
                       drafter_training=False, eval_size=4, eval_every=10)
    coord = JobCoordinator(s)
    try:
        coord.start()
        history = coord.run()
        body = coord.metrics()[0].decode()
    finally:
        coord.shutdown()
    rewards = [h["reward_mean"] for h in history]
    # evalEvery: a held-out greedy evaluation after steps 10 and 20, exported as a gauge
    assert [h["step"] for h in history if h["eval_accuracy"] is not None] == [9, 19]
    assert all(0.0 <= h["eval_accuracy"] <= 1.0 for h in history if h["eval_accuracy"] is not None)
    assert any(x.startswith("specrl_eval_accuracy_ratio{") for x in body.splitlines())
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= 0.85 and last >= first + 0.25, rewards


def test_drain_and_worker_death_mid_rollout_lose_nothing(local_ray, micro):
    """A drain and a worker death while chunks are out; the dataset (5 rows, 6 prompts per step) makes every step
    draw some row twice (13.15): each draw is its own prompt, trained exactly once."""
    import ray

    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=2, rollouts=3, prompts_per_step=6, max_new_tokens=96, drafter_training=False,
                       dataset_size=5)
    coord = JobCoordinator(s, token="t", http_port=free_port())
    try:
        coord.start()
        assert coord.url is not None
        t, box = _run_in_thread(coord.run)
        drained = killed = None
        deadline = time.monotonic() + 120
        while t.is_alive() and time.monotonic() < deadline and (drained is None or killed is None):
            with coord.lock:
                holders = {c.worker for c in list(coord.pool.in_flight.values()) if c.items}
            if drained is None and "micro-rollout-1" in holders:
                r = httpx.post(coord.url + "/drain", json={"worker": "micro-rollout-1"},
                               headers={"Authorization": "Bearer t"})
                assert r.status_code == 202
                drained = "micro-rollout-1"
            if killed is None and "micro-rollout-2" in holders:
                ray.kill(coord.rollouts["micro-rollout-2"])
                killed = "micro-rollout-2"
            time.sleep(0.002)
        history = _finish(t, box)
        assert drained and killed, "could not catch the workers mid-rollout"
        states = {w["name"]: w["state"] for w in coord.status()["workers"]}
        assert states["micro-rollout-1"] == "retired" and states["micro-rollout-2"] == "lost"  # drained / died
        assert states["micro-rollout-0"] == "active"
        assert coord.ledger.requeued >= 1  # the killed worker's chunk went back to the queue
        assert len(history) == 2
        _assert_ledger_clean(coord, 2, s.prompts_per_step)
    finally:
        coord.shutdown()


def test_crash_resume_gives_bit_identical_weights(local_ray, micro, tmp_path):
    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=3, rollouts=1, checkpoint_dir=str(tmp_path), checkpoint_interval=1,
                       reward="rewards_for_tests:length_reward")
    a = JobCoordinator(s)
    try:
        a.start()
        first = a.trainer_digest()
        a.run()
        reference = a.trainer_digest()
        assert reference != first, "the policy must move for this test to mean anything"
        trained = a.ledger_report()["trained_ids"]
        hist_a = a.get_history()
    finally:
        a.shutdown()  # the "crash": every actor of the first run is gone
    assert (tmp_path / "step-000002" / "COMPLETE").is_file()
    b = JobCoordinator(s, resume_from=str(tmp_path / "step-000002"))
    try:
        b.start()
        assert b.step == 2 and b.weight_version == 2
        b.run()
        assert b.trainer_digest() == reference
        assert b.ledger_report()["trained_ids"] == trained
        hist_b = b.get_history()
        assert [h["reward_mean"] for h in hist_b] == [h["reward_mean"] for h in hist_a]
        assert hist_b[-1]["response_lengths"] == hist_a[-1]["response_lengths"]
    finally:
        b.shutdown()
