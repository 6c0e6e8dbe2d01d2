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


def test_dataset_without_a_usable_line_fails_before_ray(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('not json\n{"prompt": 1}\n[1, 2]\n')
    job = _job(tmp_path, f"  dataset: {{type: jsonl, path: {data}}}\n")
    r = _run(["run", str(job), "--no-progress"], tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1] == (f"specrl run: {job}: bad: spec.dataset.path: dataset file {str(data)!r} has no "
                                         "valid lines (3 malformed)")
    assert not (tmp_path / "runs").exists()  # nothing created
    job = _job(tmp_path, f"  dataset: {{type: jsonl, path: {tmp_path}}}\n")
    r = _run(["run", str(job), "--no-progress"], tmp_path)
    assert r.returncode == 1 and f"spec.dataset.path: dataset path {str(tmp_path)!r} is a directory" in r.stderr
    r = _run(["run", str(tmp_path)], tmp_path)
    assert r.returncode == 1 and r.stderr == f"specrl run: {tmp_path}: is a directory\n"


@pytest.mark.parametrize("out", ["afile", "afile/sub"])
def test_out_under_an_existing_file_is_one_line_before_any_work(tmp_path, out):
    (tmp_path / "afile").write_text("x")
    job = _job(tmp_path, "  algorithm: {groupSize: 1}\n")  # invalid too: --out is checked first, without loading
    r = _run(["run", str(job), "--out", out], tmp_path)
    assert r.returncode == 1
    assert r.stderr == "specrl run: --out: 'afile' exists and is not a directory\n" if out == "afile" else \
        r.stderr == "specrl run: --out: 'afile' is not a directory\n"


def test_steps_override_keeps_the_spec_bound(tmp_path):
    job = _job(tmp_path, "  mode: sync\n")
    r = _run(["run", str(job), "--steps", "1000001"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "argument --steps: must be less than or equal to 1000000" in r.stderr
    from specrl.runtime.local import JobError, load_settings

    with pytest.raises(JobError, match=r"^--steps: must be less than or equal to 1000000"):
        load_settings(str(job), steps=2_000_000)


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
