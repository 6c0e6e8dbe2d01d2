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


def _worker_counter(coord: JobCoordinator, name: str, worker: str) -> float:
    body = coord.metrics()[0].decode()
    line = next(x for x in body.splitlines() if x.startswith(name + "{") and f'worker="{worker}"' in x)
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
    from specrl.runtime.rl.task import SyntheticTask

    from tests.integration.rlrun.micro import micro_settings

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
                held = [(c.worker, [it.index for it in c.items]) for c in list(coord.pool.in_flight.values())]
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
        ((dropped_id, reason),) = coord.ledger.dropped.items()
        assert "ValueError" in reason and coord.ledger.failures[dropped_id] == 2
        states = {w["name"]: w["state"] for w in coord.status()["workers"] if w["role"] == "rollout"}
        assert states[frozen_worker] == "retired"
        assert sorted(states.values()) == ["active", "active", "retired"], states  # the task error retired no one
        assert _counter(coord, "specrl_rollout_task_errors_total") == 2
        assert _counter(coord, "specrl_rollout_prompts_dropped_total") == 1
        assert _counter(coord, "specrl_rollout_chunk_timeouts_total") == 1
        assert _counter(coord, "specrl_reward_timeouts_total") == s.group_size
        assert _counter(coord, "specrl_reward_errors_total") == s.group_size  # a timeout is a counted reward error
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


def _digest(actor) -> str:
    import ray

    def digest(self):
        from specrl.runtime.rl.trainer import weights_digest

        self._apply_pending()  # what every rollout does first: staged weights are swapped in
        return weights_digest(self.model)

    return ray.get(actor.__ray_call__.remote(digest))


def _die_in_next_receive(self) -> bool:
    """Make this rollout worker's process exit inside its next weight receive (after the group is built)."""
    from specrl.runtime.sync import WeightReceiver

    def die(*_a, **_k):
        os._exit(1)

    setattr(WeightReceiver, "receive", die)  # noqa: B010 - patched in the worker's process on purpose
    return True


def test_receivers_that_die_around_a_weight_sync_are_left_out(local_ray, micro):
    """13.13: rollout-1 dies inside the transfer of version 2 (its process exits in `receive`); rollout-2 is
    SIGKILLed while step 1 trains (gone before the sync starts). Both are left out, the group is rebuilt over
    rollout-0, the weights are sent again, and the job goes on with rollout-0 serving the trainer's weights."""
    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=3, rollouts=3, drafter_training=False, sync_timeout_s=20.0)
    coord = JobCoordinator(s)
    try:
        coord.start()
        coord.run_step()
        import ray

        ray.get(coord.rollouts["micro-rollout-1"].__ray_call__.remote(_die_in_next_receive))
        victim = _pid(coord.rollouts["micro-rollout-2"])
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("rec", coord.run_step()), daemon=True)
        t.start()
        while t.is_alive() and coord.status()["phase"] != "Training":
            time.sleep(0.002)
        os.kill(victim, signal.SIGKILL)
        t.join(180)
        assert not t.is_alive() and "rec" in box, "step 1 did not finish"
        assert box["rec"]["sync_bytes"] > 0
        coord.run()
        states = {w["name"]: w["state"] for w in coord.status()["workers"] if w["role"] == "rollout"}
        # both died (their pods fail and are replaced): lost, never "retired" (the operator deletes retired pods)
        assert states == {"micro-rollout-0": "active", "micro-rollout-1": "lost", "micro-rollout-2": "lost"}
        assert _counter(coord, "specrl_weight_sync_failures_total") >= 1
        assert coord.rollout_version == 3
        assert _digest(coord.rollouts["micro-rollout-0"]) == coord.trainer_digest()
        rep = coord.ledger_report()
        assert rep["lost"] == 0 and rep["trained"] == rep["issued"] == 3 * s.prompts_per_step
    finally:
        coord.shutdown()


def test_version_zero_is_shipped_at_start(local_ray, micro):
    """13.17: a rollout worker that starts from other weights (a pod that resolved another model revision) serves
    the trainer's weights before its first rollout."""
    import ray

    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=1, rollouts=1, drafter_training=False)
    coord = JobCoordinator(s)
    add = coord.pool.add

    def add_other_revision(name, initial=None, node_id=None):
        add(name, initial, node_id)

        def perturb(self):
            import torch

            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(0.01)
            return True

        ray.get(coord.pool.actors[name].__ray_call__.remote(perturb))

    setattr(coord.pool, "add", add_other_revision)  # noqa: B010 - a pod that resolved another revision
    try:
        coord.start()
        assert _digest(coord.rollouts["micro-rollout-0"]) == coord.trainer_digest()
        assert coord.rollout_version == 0
    finally:
        coord.shutdown()


def test_async_checkpoint_with_prompts_in_flight_resumes_exactly_once(local_ray, micro, tmp_path):
    """13.16: async mode with a checkpoint after every step. At each boundary the next step's prompts are in flight
    or done but untrained; the checkpoint saves them as queued, and a job resumed from it trains every draw of
    the whole job exactly once."""
    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=3, rollouts=2, mode="async", max_staleness=1, drafter_training=False,
                       checkpoint_dir=str(tmp_path), checkpoint_interval=1, checkpoint_keep=5)
    a = JobCoordinator(s)
    try:
        a.start()
        a.run_step()
        t0 = time.perf_counter()
        a.run_step()
        print(f"step with a checkpoint: {time.perf_counter() - t0:.1f}s")
    finally:
        a.shutdown()  # the crash
    assert (tmp_path / "step-000002" / "COMPLETE").is_file()
    b = JobCoordinator(s)  # a restarted job: it asks trainer rank 0 for the newest complete checkpoint
    try:
        b.start()
        assert b.resumed_from() == str(tmp_path / "step-000002") and b.step == 2
        # step 2's prompts were in flight or done-but-untrained at the checkpoint: they come back queued, first
        assert [it.prompt_id for it in b.ledger.queue][: s.prompts_per_step] == \
            [f"s2-p{k}" for k in range(s.prompts_per_step)]
        assert len(b.ledger.trained) == 2 * s.prompts_per_step
        b.run()
        rep = b.ledger_report()
        every = sorted(f"s{st}-p{k}" for st in range(3) for k in range(s.prompts_per_step))
        assert rep["trained_ids"] == every and rep["lost"] == 0 and rep["dropped"] == 0
        assert [h["step"] for h in b.get_history()] == [0, 1, 2]
    finally:
        b.shutdown()


def test_async_job_learns_while_rollouts_and_training_overlap(local_ray, micro, tmp_path):
    """13.18: async mode (maxStaleness 1) on a JSONL dataset learns a behaviour the reward pays for, and the next
    step's rollouts run while the trainers work (chunks of later steps finish during training)."""
    from specrl.runtime.rl.task import SyntheticTask

    from tests.integration.rlrun.micro import micro_settings

    data = tmp_path / "train.jsonl"
    lines = [json.dumps({"prompt": p.prompt, "answer": p.answer}) for p in SyntheticTask(64, None, 5)]
    lines.insert(3, "{not json")  # skipped with a counted warning
    data.write_text("\n".join(lines) + "\n")
    # 20 steps at lr 1e-2: at 2e-2 the reward dipped around steps 5-7 before it climbed (to 0.25-0.41), and two CI
    # runs never climbed back (last three 0.50 after 16 steps, 0.42 after 20); at 1e-2 it dips to 0.41-0.44 and its
    # last three steps average 0.84-0.95 (five runs; first three 0.49-0.51)
    s = micro_settings(steps=20, prompts_per_step=8, group_size=4, lr=1e-2, rollouts=2, mode="async",
                       max_staleness=1, reward="rewards_for_tests:starts_with_digit", drafter_training=False,
                       dataset=str(data), eval_size=4)
    coord = JobCoordinator(s)
    try:
        coord.start()
        history = coord.run()
        assert max(h["staleness_max"] for h in history) <= 1
        assert any(h["staleness_max"] == 1 for h in history), "async mode never ran ahead"
        # How many steps overlap depends on the machine's load (4-12 of 20 beside a busy core; a check for at least
        # 10 failed there at 9); that any does is what async mode promises and what sync mode (always 0) cannot show.
        overlapped = [h["overlap_chunks"] for h in history]
        assert sum(overlapped) > 0, overlapped
        rewards = [h["reward_mean"] for h in history]
        first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
        assert last >= first + 0.2, rewards
        assert _counter(coord, "specrl_dataset_malformed_lines_total") == 1
        rep = coord.ledger_report()
        assert rep["lost"] == 0 and rep["trained"] == rep["issued"] == s.steps * s.prompts_per_step
    finally:
        coord.shutdown()


def _die_in_next_all_reduce(self) -> bool:
    """Make this trainer's process exit inside its next gradient all-reduce (mid-step: its peer is in it too)."""

    def die() -> None:
        os._exit(1)

    self._all_reduce_grads = die
    return True


def _exactly_once(coord: JobCoordinator, steps: int) -> None:
    rep = coord.ledger_report()
    assert rep["lost"] == 0 and rep["dropped"] == 0
    assert rep["trained"] == steps * coord.settings.prompts_per_step == len(set(rep["trained_ids"]))
    assert [r["step"] for r in coord.history] == list(range(steps))


def test_a_trainer_that_dies_mid_step_is_replaced_and_the_step_trained_again(local_ray, micro):
    """Trainer rank 0 (the weight sender, the drafter's holder) exits inside the all-reduce of step 1: rank 1's
    all-reduce fails with it, both return, rank 1 (still on version 1) reseeds a new group with a respawned
    trainer-0, step 1 is trained again on the same samples, and the job completes: every prompt trained once."""
    import ray

    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=3, trainers=2, rollouts=1, drafter_training=False)
    coord = JobCoordinator(s)
    try:
        coord.start()
        coord.run_step()
        old = coord.trainers[f"{s.job}-trainer-0"]
        ray.get(old.__ray_call__.remote(_die_in_next_all_reduce))
        coord.run()
        _exactly_once(coord, 3)
        ((rec,),) = [coord.status()["trainerRecoveries"]]
        assert (rec["step"], rec["action"], rec["lost"], rec["source"]) == (
            1, "continue", [f"{s.job}-trainer-0"], f"{s.job}-trainer-1")
        assert sorted(coord.trainers) == [f"{s.job}-trainer-0", f"{s.job}-trainer-1"]
        assert coord.trainers[f"{s.job}-trainer-0"] is not old
        digests = ray.get([a.digest.remote() for a in coord.trainers.values()])
        assert len(set(digests)) == 1  # the new member copied the group's weights
        assert coord.status()["weightVersion"] == 3
    finally:
        coord.shutdown()


def test_the_last_trainer_dying_rolls_the_job_back_to_its_checkpoint(local_ray, micro, tmp_path):
    """The only trainer's process is SIGKILLed after step 2 (checkpoint every 2 steps): there is no survivor, so
    a new trainer loads the newest complete checkpoint, the ledger goes back with it, and steps 2.. run again;
    the job completes with every prompt trained once in the ledger."""
    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=4, trainers=1, rollouts=1, drafter_training=False, checkpoint_dir=str(tmp_path),
                       checkpoint_interval=2)
    coord = JobCoordinator(s)
    try:
        coord.start()
        coord.run_step()
        coord.run_step()
        coord.run_step()  # step 2 trained, not checkpointed: it is lost with the trainer
        os.kill(_pid(coord.trainers[f"{s.job}-trainer-0"]), signal.SIGKILL)
        coord.run()
        _exactly_once(coord, 4)
        ((rec,),) = [coord.status()["trainerRecoveries"]]
        assert (rec["step"], rec["action"], rec["lost"]) == (3, "restore", [f"{s.job}-trainer-0"])
        assert rec["source"].endswith("step-000002")
        assert coord.status()["weightVersion"] == 4
        # The respawned trainer's series counts steps 2 and 3 as work done; step 2 was trained before the
        # rollback, so it also counts as re-trained (the ledger above counts it once).
        worker = f"{s.job}-trainer-0"
        assert _worker_counter(coord, "specrl_trainer_samples_total", worker) == 2 * s.step_batch
        assert _worker_counter(coord, "specrl_trainer_samples_retrained_total", worker) == s.step_batch
    finally:
        coord.shutdown()


def _stop_in_next_all_reduce(self) -> int:
    """Make this trainer's process freeze itself (SIGSTOP: alive, its sockets open, silent) on entering its next
    gradient all-reduce, while its peer is in it. Returns the process id."""
    real = self._all_reduce_grads

    def stop() -> None:
        os.kill(os.getpid(), signal.SIGSTOP)
        real()

    self._all_reduce_grads = stop
    return os.getpid()


def test_a_trainer_frozen_mid_all_reduce_is_found_within_the_collective_timeout(local_ray, micro):
    """Trainer rank 1 freezes (SIGSTOP, not a death) inside step 1's all-reduce. Rank 0's all-reduce fails after
    faultTolerance.collectiveTimeoutSeconds (not torch's 30 min), the frozen rank answers no health check and is
    dropped, rank 0 (still on version 1) reseeds the group with a respawned trainer-1, and step 1 is trained
    again: the job completes with every prompt trained once, well within the bound."""
    import ray

    from tests.integration.rlrun.micro import micro_settings

    timeout_s = 4.0
    s = micro_settings(steps=3, trainers=2, rollouts=1, drafter_training=False, collective_timeout_s=timeout_s)
    coord = JobCoordinator(s)
    frozen = None
    try:
        coord.start()
        coord.run_step()
        frozen = ray.get(coord.trainers[f"{s.job}-trainer-1"].__ray_call__.remote(_stop_in_next_all_reduce))
        t0 = time.monotonic()
        coord.run_step()  # step 1: trained after the recovery
        recovered_s = time.monotonic() - t0
        coord.run()
        _exactly_once(coord, 3)
        ((rec,),) = [coord.status()["trainerRecoveries"]]
        assert (rec["step"], rec["action"], rec["lost"], rec["source"]) == (
            1, "continue", [f"{s.job}-trainer-1"], f"{s.job}-trainer-0")
        # the rank-0 timeout, the wait for the other ranks, the 10 s health check, then the respawned trainer's
        # start, the regroup and the step (a minute on a loaded machine, so four are allowed: the bound is there
        # to tell this from torch's default timeout, 30 min, not to time the machine)
        bound = 2 * timeout_s + 10.0 + 240.0
        print(f"step 1 with a frozen trainer took {recovered_s:.1f}s (bound {bound:g}s)")
        assert recovered_s < bound
        digests = ray.get([a.digest.remote() for a in coord.trainers.values()])
        assert len(set(digests)) == 1
        # hung, not dead: retired (in a cluster its pod lives on, and the operator replaces a retired pod)
        assert rec["hung"] == [f"{s.job}-trainer-1"]
    finally:
        coord.shutdown()
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)  # the frozen Ray worker, if the kill did not reach it
            except ProcessLookupError:
                pass


def _drafter_digest(self) -> str:
    from specrl.runtime.rl.trainer import weights_digest

    return weights_digest(self.drafter.model) if self.drafter is not None else ""


def _hold_the_tail(self) -> None:
    """Keep each finished `generate` reporting its last decode batch for 0.6 s more: the micro policy's rollouts
    take milliseconds, so the coordinator's poll (every 0.25 s) could miss the long tail in which the drafter
    trains; this makes the tail, and so drafter training, certain in every step."""
    import time as _time

    real = self.engine.generate

    def generate(*args, **kwargs):
        out = real(*args, **kwargs)
        _time.sleep(0.6)
        return out

    self.engine.generate = generate


def test_a_new_rank_0_takes_over_the_newest_drafter(local_ray, micro, tmp_path):
    """Trainer rank 0 (the drafter's master copy) is SIGKILLed twice between steps (checkpoints every 2 steps).
    After step 1 the checkpoint holds the newest drafter: the survivor, now rank 0, loads it (weights, optimizer,
    replay buffer). After step 2 the rollout worker serves a newer drafter (version 3) than the checkpoint
    (version 2): its weights are taken. Never the drafter as loaded; every prompt is trained once."""
    import ray
    from specrl.runtime.models.hub import load_causal_lm
    from specrl.runtime.rl.trainer import weights_digest

    from tests.integration.rlrun.micro import micro_settings

    s = micro_settings(steps=4, trainers=2, rollouts=1, checkpoint_dir=str(tmp_path), checkpoint_interval=2)
    assert s.draft_model is not None
    as_loaded = weights_digest(load_causal_lm(s.draft_model, "float32"))
    coord = JobCoordinator(s)
    try:
        coord.start()
        ray.get([a.__ray_call__.remote(_hold_the_tail) for a in coord.rollouts.values()])
        coord.run_step()
        coord.run_step()
        for expected_source in (str(tmp_path / "step-000002"), f"{s.job}-rollout-0 (version 3)"):
            rank0 = coord.trainer_group.first()
            trained = ray.get(rank0.__ray_call__.remote(_drafter_digest))
            assert trained != as_loaded, "the drafter never trained"
            os.kill(_pid(rank0), signal.SIGKILL)
            coord.run_step()  # no drafter round (rank 0 is gone), then the recovery: the step trains, and syncs
            rec = coord.status()["trainerRecoveries"][-1]
            assert rec["action"] == "continue" and rec["drafter"] == expected_source, rec
            assert ray.get(coord.trainer_group.first().__ray_call__.remote(_drafter_digest)) == trained
        coord.run()
        _exactly_once(coord, 4)
    finally:
        coord.shutdown()
