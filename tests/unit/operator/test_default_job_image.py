"""The operator's default job image (`--default-job-image`, the chart's `jobImage`): used for jobs that name no
image, recorded per job, and never swapped under a running job when the default changes."""

from __future__ import annotations

import copy

import pytest
from specrl.operator import children
from specrl.operator.reconcile import PodInfo, reconcile
from specrl.operator.status import get_condition
from specrl.runtime.api import DEFAULT_IMAGE, RLJob

from tests.unit.operator.conditions import require_condition

from .test_reconcile import JOB, env, run  # noqa: F401 - `env` is a fixture

MIRROR = "registry.internal/mirror/specrl:0.1.0"


def _pod_images(kube) -> set[str]:
    return {c["image"] for (kind, _), obj in kube.objects.items() if kind == "Pod"
            for c in obj["spec"]["containers"]}


def test_image_of_prefers_the_job_then_the_operator_default(monkeypatch: pytest.MonkeyPatch) -> None:
    unset = RLJob.model_validate(JOB)
    assert unset.spec.resources.image is None
    monkeypatch.delenv(children.DEFAULT_JOB_IMAGE_ENV, raising=False)
    assert children.image_of(unset) == DEFAULT_IMAGE
    monkeypatch.setenv(children.DEFAULT_JOB_IMAGE_ENV, MIRROR)
    assert children.image_of(unset) == MIRROR
    own = copy.deepcopy(JOB)
    own["spec"]["resources"]["image"] = "example/own:1"
    assert children.image_of(RLJob.model_validate(own)) == "example/own:1"


async def test_a_running_job_keeps_the_image_it_started_with(env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    rt, kube, _coord, _events, clock = env
    monkeypatch.setenv(children.DEFAULT_JOB_IMAGE_ENV, MIRROR)
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    assert _pod_images(kube) == {MIRROR}
    assert body["status"]["applied"]["image"] == MIRROR
    # The chart's jobImage changes (helm upgrade): the running job is not Degraded and new pods keep its image.
    monkeypatch.setenv(children.DEFAULT_JOB_IMAGE_ENV, "registry.internal/mirror/specrl:0.2.0")
    # A worker pod fails: the operator deletes it and, after the restart backoff, creates it again.
    (failed,) = [p for p in kube.pods() if p.name == "j-rollout-1"]
    others = [p for p in kube.pods() if p.name != "j-rollout-1"]
    bad = PodInfo(failed.name, "rollout", 1, failed.uid, "Failed", False, "Error (exit code 1)")
    patch = await reconcile(rt, body, [*others, bad], "timer")
    body["status"].update({k: v for k, v in patch.items() if v is not None})
    for p in kube.status_patches:
        body["status"].update({k: v for k, v in p.items() if v is not None})
    kube.status_patches.clear()
    assert ("Pod", "j-rollout-1") not in kube.objects
    clock.t += 11
    await run(rt, kube, body, "timer")
    assert ("Pod", "j-rollout-1") in kube.objects
    assert get_condition(body["status"], "Degraded") is None or \
        require_condition(body["status"], "Degraded")["status"] == "False"
    assert _pod_images(kube) == {MIRROR}


def test_a_role_may_name_its_own_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(children.DEFAULT_JOB_IMAGE_ENV, raising=False)
    doc = copy.deepcopy(JOB)
    doc["spec"]["resources"]["image"] = "example/job:1"
    doc["spec"]["resources"]["coordinator"] = {"image": "example/cpu-only:1"}
    doc["spec"]["resources"].setdefault("rollout", {})["image"] = "example/vllm:1"
    job = RLJob.model_validate(doc)
    owner = children.Owner("j", "ns", "u")
    images = {role: children.pod(job, owner, role, 0)["spec"]["containers"][0]["image"]
              for role in ("coordinator", "trainer", "rollout")}
    assert images == {"coordinator": "example/cpu-only:1", "trainer": "example/job:1", "rollout": "example/vllm:1"}
    assert children.role_images(job) == {"coordinator": "example/cpu-only:1", "rollout": "example/vllm:1"}


async def test_a_running_job_keeps_its_role_images(env) -> None:  # noqa: F811
    rt, kube, _coord, _events, _clock = env
    body = copy.deepcopy(JOB)
    body["spec"]["resources"].setdefault("rollout", {})["image"] = "example/vllm:1"
    await run(rt, kube, body, "create")
    assert body["status"]["applied"]["roleImages"] == {"rollout": "example/vllm:1"}
    body["spec"]["resources"]["rollout"]["image"] = "example/vllm:2"
    body["spec"]["resources"]["trainer"] = {**body["spec"]["resources"].get("trainer", {}), "image": "example/t:2"}
    await run(rt, kube, body, "timer")
    cond = require_condition(body["status"], "Degraded")
    assert (cond["status"], cond["reason"]) == ("True", "ImmutableFieldChanged")
    assert "spec.resources.rollout.image is immutable: running 'example/vllm:1', requested 'example/vllm:2'" \
        in cond["message"]
    assert "spec.resources.trainer.image is immutable: running 'the job image', requested 'example/t:2'" \
        in cond["message"]
    # a rollout pod that is gone comes back with the image the job started with
    del kube.objects[("Pod", "j-rollout-0")]
    await run(rt, kube, body, "timer")
    rollout = [obj for (kind, name), obj in kube.objects.items() if kind == "Pod" and "-rollout-" in name]
    assert ("Pod", "j-rollout-0") in kube.objects
    assert {p["spec"]["containers"][0]["image"] for p in rollout} == {"example/vllm:1"}
