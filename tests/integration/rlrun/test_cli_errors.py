"""`specrl run` and `specrl worker` on bad input: one clear line naming the problem, exit code, no traceback."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SPECRL = [sys.executable, "-m", "specrl.runtime.cli"]


def _run(args, tmp_path, env=None, timeout=120):
    return subprocess.run(SPECRL + args, check=False, capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                          env={**os.environ, **(env or {})})


def _job(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: bad}\nspec:\n" + body)
    return p


def test_missing_dataset_file_names_the_field(tmp_path):
    job = _job(tmp_path, "  dataset: {type: jsonl, path: /nonexistent/gsm8k.jsonl}\n")
    r = _run(["run", str(job), "--no-progress"], tmp_path)
    assert r.returncode == 1
    assert "spec.dataset.path" in r.stderr and "/nonexistent/gsm8k.jsonl" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "runs").exists()  # no partial state


def test_reward_function_not_installed(tmp_path):
    job = _job(tmp_path, "  reward: {type: function, function: 'nosuchpkg.rewards:score'}\n")
    r = _run(["run", str(job)], tmp_path)
    assert r.returncode == 1 and "spec.reward.function" in r.stderr and "nosuchpkg" in r.stderr
    assert "Traceback" not in r.stderr


def test_invalid_spec_and_missing_file(tmp_path):
    job = _job(tmp_path, "  algorithm: {groupSize: 1}\n")
    r = _run(["run", str(job)], tmp_path)
    assert r.returncode == 1 and "groupSize" in r.stderr and "Traceback" not in r.stderr
    r = _run(["run", str(tmp_path / "nope.yaml")], tmp_path)
    assert r.returncode == 1 and "nope.yaml" in r.stderr and "Traceback" not in r.stderr
    r = _run(["run", str(job), "--steps", "0"], tmp_path)
    assert r.returncode == 2 and "--steps: must be >= 1" in r.stderr  # a usage error


def test_worker_gives_up_on_unreachable_coordinator(tmp_path):
    job = _job(tmp_path, "  mode: sync\n")
    env = {"SPECRL_WORKER": "bad-rollout-0", "SPECRL_RAY_ADDRESS": "127.0.0.1:9",
           "SPECRL_COORDINATOR_ADDR": "127.0.0.1:9", "SPECRL_CONNECT_TIMEOUT": "1.5"}
    r = _run(["worker", "rollout", "--config", str(job)], tmp_path, env=env)
    assert r.returncode == 1
    assert "coordinator unreachable at 127.0.0.1:9" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("retrying") >= 2  # it retried with backoff before giving up
    r = _run(["worker", "trainer", "--config", str(job)], tmp_path, env={"SPECRL_WORKER": "", "SPECRL_RAY_ADDRESS": ""})
    assert r.returncode == 1 and "SPECRL_WORKER" in r.stderr


def test_worker_checks_the_model_before_joining(tmp_path):
    # A trainer pod whose model folder is missing fails at once with the field, before any wait for the
    # coordinator (the address below would otherwise be retried for SPECRL_CONNECT_TIMEOUT seconds).
    job = _job(tmp_path, f"  model: {{name: {tmp_path / 'no-such-model'}}}\n")
    env = {"SPECRL_WORKER": "bad-trainer-0", "SPECRL_RAY_ADDRESS": "127.0.0.1:9",
           "SPECRL_COORDINATOR_ADDR": "127.0.0.1:9", "SPECRL_CONNECT_TIMEOUT": "60"}
    r = _run(["worker", "trainer", "--config", str(job)], tmp_path, env=env, timeout=50)
    assert r.returncode == 1
    assert "spec.model.name" in r.stderr and "no-such-model" in r.stderr
    assert "Traceback" not in r.stderr and "retrying" not in r.stderr


def test_backoff_delays_are_bounded():
    from specrl.runtime.worker import backoff_delays

    d = backoff_delays(30)
    assert d[0] == 0.5 and all(b >= a for a, b in itertools.pairwise(d)) and max(d) <= 10 and sum(d) <= 30
