"""API-server behaviour of the emulator over HTTP: the gaps of plain KMock that it fills."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration

CM = "/api/v1/namespaces/default/configmaps"
RLJ = "/apis/specrl.io/v1alpha1/namespaces/default/rljobs"
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest.fixture
def http(kube):
    with httpx.Client(base_url=kube.url, timeout=10) as client:
        yield client


def _cm(name: str, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels or {}, **meta},
            "data": {"k": "v"}}


def _job(name: str = "j", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "specrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


def test_create_stamps_server_metadata_and_lists_have_kinds(http):
    r = http.post(CM, json=_cm("a"))
    assert r.status_code == 201
    meta = r.json()["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1 and meta["namespace"] == "default"
    r2 = http.post(CM, json=_cm("b")).json()
    assert int(r2["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert r2["metadata"]["uid"] != meta["uid"]
    lst = http.get(CM).json()
    assert lst["kind"] == "ConfigMapList" and lst["apiVersion"] == "v1"
    assert int(lst["metadata"]["resourceVersion"]) >= int(r2["metadata"]["resourceVersion"])
    assert [i["metadata"]["name"] for i in lst["items"]] == ["a", "b"]
    assert http.post(CM, json=_cm("a")).status_code == 409
    gen = http.post(CM, json={"metadata": {"generateName": "x-"}, "data": {}}).json()["metadata"]["name"]
    assert gen.startswith("x-") and len(gen) > 2
    assert http.get("/api/v1").json()["groupVersion"] == "v1"


def test_missing_namespace_and_unknown_objects_are_404(http):
    assert http.post("/api/v1/namespaces/nope/configmaps", json=_cm("a")).status_code == 404
    assert http.get(f"{CM}/ghost").status_code == 404
    assert http.patch(f"{CM}/ghost", json={}, headers=MERGE).status_code == 404
    assert http.delete(f"{CM}/ghost").status_code == 404


def test_generation_moves_with_spec_only_and_status_subresource_is_separate(http):
    http.post(RLJ, json=_job(suspend=False))
    r = http.patch(f"{RLJ}/j", json={"metadata": {"labels": {"a": "b"}}}, headers=MERGE).json()
    assert r["metadata"]["generation"] == 1 and r["metadata"]["labels"] == {"a": "b"}
    r = http.patch(f"{RLJ}/j", json={"spec": {"suspend": True}, "status": {"phase": "Hacked"}}, headers=MERGE).json()
    assert r["metadata"]["generation"] == 2 and "status" not in r  # main resource ignores status
    r = http.patch(f"{RLJ}/j/status", json={"status": {"phase": "Running"}, "spec": {"suspend": False}},
                   headers=MERGE).json()
    assert r["status"]["phase"] == "Running" and r["spec"]["suspend"] is True and r["metadata"]["generation"] == 2
    before = r["metadata"]["resourceVersion"]
    same = http.patch(f"{RLJ}/j/status", json={"status": {"phase": "Running"}}, headers=MERGE).json()
    assert same["metadata"]["resourceVersion"] == before  # a no-op write changes nothing


def test_schema_validation_defaults_and_pruning(http):
    r = http.post(RLJ, json=_job("bad", mode="async", maxStaleness=0))
    assert r.status_code == 422 and "async mode needs maxStaleness >= 1" in r.json()["message"]
    assert r.json()["details"]["causes"][0]["field"] == "spec.maxStaleness"
    r = http.post(f"{RLJ}?fieldValidation=Strict", json=_job("strict", typo=1))
    assert r.status_code == 400 and r.json()["message"] == 'strict decoding error: unknown field "spec.typo"'
    r = http.post(f"{RLJ}?fieldValidation=Ignore", json=_job("lenient", typo=1))
    assert r.status_code == 201 and "typo" not in r.json()["spec"]
    assert r.json()["spec"]["algorithm"]["groupSize"] == 8  # CRD defaults applied
    r = http.patch(f"{RLJ}/lenient", json={"spec": {"algorithm": {"steps": 0}}}, headers=MERGE)
    assert r.status_code == 422 and "spec.algorithm.steps" in r.json()["message"]


def test_patch_flavours_replace_and_preconditions(http):
    obj = http.post(CM, json=_cm("a")).json()
    r = http.patch(f"{CM}/a", json=[{"op": "add", "path": "/data/x", "value": "1"}],
                   headers={"Content-Type": "application/json-patch+json"})
    assert r.json()["data"] == {"k": "v", "x": "1"}
    r = http.patch(f"{CM}/a", json={"data": {"k": None}}, headers=MERGE)
    assert r.json()["data"] == {"x": "1"}
    stale = {**obj, "data": {"z": "9"}}
    assert http.put(f"{CM}/a", json=stale).status_code == 409  # old resourceVersion
    fresh = http.get(f"{CM}/a").json()
    r = http.put(f"{CM}/a", json={**fresh, "data": {"z": "9"}})
    assert r.status_code == 200 and r.json()["data"] == {"z": "9"}
    assert r.json()["metadata"]["uid"] == obj["metadata"]["uid"]
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i1"}, {"name": "d", "image": "x"}]}}
    http.post("/api/v1/namespaces/default/pods", json=pod)
    r = http.patch("/api/v1/namespaces/default/pods/p", json={"spec": {"containers": [{"name": "c", "image": "i2"}]}},
                   headers={"Content-Type": "application/strategic-merge-patch+json"}).json()
    assert [(c["name"], c["image"]) for c in r["spec"]["containers"]] == [("c", "i2"), ("d", "x")]
    assert r["status"]["phase"] == "Pending"
    assert http.post(f"{CM}?dryRun=All", json=_cm("dry")).status_code == 201
    assert http.get(f"{CM}/dry").status_code == 404


def test_label_and_field_selectors(http):
    http.post(CM, json=_cm("a", {"app": "x", "role": "trainer"}))
    http.post(CM, json=_cm("b", {"app": "x", "role": "rollout"}))
    http.post(CM, json=_cm("c", {"app": "y"}))

    def names(**params: str) -> list[str]:
        return [i["metadata"]["name"] for i in http.get(CM, params=params).json()["items"]]

    assert names(labelSelector="app=x") == ["a", "b"]
    assert names(labelSelector="app=x,role!=trainer") == ["b"]
    assert names(labelSelector="role in (trainer, rollout)") == ["a", "b"]
    assert names(labelSelector="role notin (trainer)") == ["b", "c"]
    assert names(labelSelector="!role") == ["c"]
    assert names(labelSelector="role") == ["a", "b"]
    assert names(fieldSelector="metadata.name=c") == ["c"]
    assert http.get(CM, params={"labelSelector": "a b c"}).status_code == 400
    assert http.delete(CM, params={"labelSelector": "app=x"}).status_code == 200
    assert names() == ["c"]


def test_finalizers_and_owner_reference_garbage_collection(http):
    job = http.post(RLJ, json=_job("owner")).json()
    owner = [{"apiVersion": "specrl.io/v1alpha1", "kind": "RLJob", "name": "owner", "uid": job["metadata"]["uid"],
              "controller": True}]
    http.post(CM, json=_cm("owned", ownerReferences=owner))
    http.post(CM, json=_cm("guarded", ownerReferences=owner, finalizers=["x/y"]))
    http.post(CM, json=_cm("free"))
    http.patch(f"{RLJ}/owner", json={"metadata": {"finalizers": ["specrl.io/cleanup"]}}, headers=MERGE)
    r = http.delete(f"{RLJ}/owner").json()
    assert r["metadata"]["deletionTimestamp"]  # held by its finalizer
    assert http.get(f"{CM}/owned").status_code == 200
    http.patch(f"{RLJ}/owner", json={"metadata": {"finalizers": None}}, headers=MERGE)
    assert http.get(f"{RLJ}/owner").status_code == 404
    assert http.get(f"{CM}/owned").status_code == 404  # collected
    guarded = http.get(f"{CM}/guarded").json()
    assert guarded["metadata"]["deletionTimestamp"]  # collected, but its own finalizer holds it
    assert http.get(f"{CM}/free").status_code == 200
    job = http.post(RLJ, json=_job("orphaner")).json()
    owner[0]["uid"], owner[0]["name"] = job["metadata"]["uid"], "orphaner"
    http.post(CM, json=_cm("orphan", ownerReferences=owner))
    http.request("DELETE", f"{RLJ}/orphaner", json={"propagationPolicy": "Orphan"})
    assert http.get(f"{CM}/orphan").status_code == 200


def test_namespace_deletion_removes_its_objects(http):
    http.post("/api/v1/namespaces", json={"metadata": {"name": "team"}})
    http.post("/api/v1/namespaces/team/configmaps", json=_cm("a"))
    assert http.get("/api/v1/namespaces/team").json()["status"]["phase"] == "Active"
    http.delete("/api/v1/namespaces/team")
    assert http.get("/api/v1/namespaces/team/configmaps/a").status_code == 404


def _watch(kube, path: str, params: dict[str, str], into: list[dict[str, Any]]) -> threading.Thread:
    def run() -> None:
        with httpx.Client(base_url=kube.url, timeout=10) as c, c.stream("GET", path, params=params) as resp:
            for line in resp.iter_lines():
                if line.strip():
                    into.append(json.loads(line))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_watch_resumes_from_a_resource_version_filters_labels_and_times_out(kube, http):
    first = http.post(CM, json=_cm("a", {"app": "x"})).json()
    http.post(CM, json=_cm("b", {"app": "y"}))
    http.patch(f"{CM}/a", json={"data": {"k": "2"}}, headers=MERGE)
    events: list[dict[str, Any]] = []
    t = _watch(kube, CM, {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"],
                          "labelSelector": "app=x", "timeoutSeconds": "2"}, events)
    time.sleep(0.3)
    http.delete(f"{CM}/a")
    t.join(5)
    assert not t.is_alive()  # timeoutSeconds ended the stream
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("MODIFIED", "a"), ("DELETED", "a")]
    events.clear()
    t = _watch(kube, CM, {"watch": "true", "timeoutSeconds": "1"}, events)  # no version: current state first
    t.join(5)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b")]


def test_request_accounting(kube, http):
    mark = kube.mark()
    http.get(CM)
    http.get(CM)
    http.post(CM, json=_cm("a"))
    assert [(m, p) for m, p, _q in kube.requests_since(mark)] == [("GET", CM), ("GET", CM), ("POST", CM)]
    assert kube.request_counts()[("GET", CM)] == 2


def test_reactions_take_precedence_and_change_nothing(kube, http):
    kube.emulator["post /api/v1/namespaces/default/configmaps"] << 403
    assert http.post(CM, json=_cm("a")).status_code == 403
    assert kube.get("v1/configmaps", "default", "a") is None


def test_server_side_table_for_kubectl_get(http):
    http.post(RLJ, json=_job("t"))
    table = http.get(RLJ, headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}).json()
    assert table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]][:3] == ["Name", "Phase", "Step"]
    assert table["rows"][0]["cells"][0] == "t"


def test_stored_examples_parse_back_into_the_models(kube):
    # What kopf hands the operator (server defaults, server metadata, kopf state in status) is a valid RLJob.
    from specrl.runtime.api import load_jobs, parse_job

    for path in ("examples/tiny-local.yaml", "examples/qwen3-8b-eagle3.yaml", "examples/async-quantized-self.yaml"):
        (job,) = load_jobs(path)
        stored = kube.create("specrl.io/v1alpha1/rljobs", job.to_dict())
        stored["metadata"]["finalizers"] = ["kopf.zalando.org/KopfFinalizerMarker"]
        stored["status"] = {"kopf": {"progress": {}}, "phase": "Running"}
        again = parse_job(json.loads(json.dumps(stored)))
        assert again.spec == job.spec  # the CRD defaults equal the model defaults
