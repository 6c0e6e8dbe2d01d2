"""The emulator against real clients: kubectl (apply/get/delete) and a kopf operator subprocess."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kube.waiting import wait_for

pytestmark = pytest.mark.integration
HERE = Path(__file__).parent


def test_kubectl_apply_stores_rljob_and_get_prints_columns(kube, kubectl):
    out = kubectl("--validate=false", "apply", "-f", "examples/tiny-local.yaml").stdout
    assert "rljob.specrl.io/tiny-local created" in out
    job = kube.get("specrl.io/v1alpha1/rljobs", "default", "tiny-local")
    assert job is not None
    meta = job["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
    assert int(meta["resourceVersion"]) > 0
    # The server applied the CRD defaults.
    assert job["spec"]["speculative"]["adaptive"]["batchSizeBuckets"] == [1, 2, 5, 21]
    assert job["spec"]["algorithm"]["clipRatio"] == 0.2

    table = kubectl("get", "rlj").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "STEP", "TRAINER", "ROLLOUT", "ACCEPT", "TAIL", "AGE"]
    assert table[1].startswith("tiny-local")
    kube.patch("specrl.io/v1alpha1/rljobs", "default", "tiny-local",
               {"status": {"phase": "Running", "step": 4, "allocation": {"trainer": {"replicas": 1, "gpus": 0},
                                                                      "rollout": {"replicas": 2, "gpus": 0}},
                           "rollout": {"acceptanceLength": 2.5, "longTail": True}}}, subresource="status")
    row = kubectl("get", "rlj", "tiny-local", "--no-headers").stdout.split()
    assert row[:7] == ["tiny-local", "Running", "4", "1", "2", "2.5", "true"]
    raw = kubectl("get", "--raw", "/apis/specrl.io/v1alpha1/namespaces/default/rljobs").stdout
    assert '"kind":"RLJobList"' in raw.replace(" ", "")

    # Re-applying the same file changes nothing; a status write did not bump the generation.
    assert "unchanged" in kubectl("--validate=false", "apply", "-f", "examples/tiny-local.yaml").stdout
    assert kube.get("specrl.io/v1alpha1/rljobs", "default", "tiny-local")["metadata"]["generation"] == 1
    kubectl("delete", "rlj", "tiny-local")
    assert kube.get("specrl.io/v1alpha1/rljobs", "default", "tiny-local") is None


def test_kubectl_apply_with_default_validation_uses_server_side_strict_checks(kube, kubectl, tmp_path):
    # kubectl finds `fieldValidation` in the emulator's OpenAPI v3 and lets the server validate strictly.
    assert "created" in kubectl("apply", "-f", "examples/qwen3-8b-eagle3.yaml").stdout
    typo = tmp_path / "typo.yaml"
    typo.write_text((kube_root := Path(__file__).resolve().parents[3] / "examples" / "tiny-local.yaml").read_text()
                    .replace("  mode: sync\n", "  mode: sync\n  moed: async\n"))
    assert kube_root.is_file()
    proc = kubectl("apply", "-f", str(typo), check=False)
    assert proc.returncode != 0 and 'unknown field "spec.moed"' in proc.stderr
    assert kube.get("specrl.io/v1alpha1/rljobs", "default", "tiny-local") is None


def test_kubectl_explain_shows_the_crd_descriptions(kubectl):
    out = kubectl("explain", "rljob.spec.speculative").stdout
    assert "KIND:       RLJob" in out and "numSpeculativeTokens" in out and "draft_model" in out
    out = kubectl("explain", "rlj.spec.resources.trainer.minReplicas").stdout
    assert "Fewest pods elastic rebalancing may leave." in out


def test_kubectl_apply_of_an_invalid_rljob_is_refused_by_the_crd_rules(kube, kubectl, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: specrl.io/v1alpha1\nkind: RLJob\nmetadata: {name: bad}\n"
                   "spec:\n  mode: async\n  maxStaleness: 0\n  speculative: {method: eagle3}\n")
    proc = kubectl("--validate=false", "apply", "-f", str(bad), check=False)
    assert proc.returncode != 0
    assert "spec.maxStaleness" in proc.stderr and "async mode needs maxStaleness >= 1" in proc.stderr
    assert "draftModel is required" in proc.stderr
    assert kube.get("specrl.io/v1alpha1/rljobs", "default", "bad") is None


def test_kopf_operator_runs_against_the_emulator(kube, kubectl, kube_env, tmp_path):
    log = (tmp_path / "kopf.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kopf", "run", "--standalone", "-A", str(HERE / "kopf_probe.py")],
                            env=kube_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        kubectl("--validate=false", "apply", "-f", "examples/tiny-local.yaml")
        job = wait_for(lambda: (j := kube.get("specrl.io/v1alpha1/rljobs", "default", "tiny-local"))
                    and (j.get("status") or {}).get("phase") == "Running" and j, 25, "kopf to set status.phase")
        assert job["status"]["step"] == 3
        assert job["metadata"]["finalizers"]  # kopf guards its delete handler with a finalizer
        cms = kube.list("v1/configmaps", "default", labels="specrl.io/job=tiny-local")
        assert [c["metadata"]["name"] for c in cms] == ["tiny-local-config"]

        kubectl("delete", "rlj", "tiny-local", "--wait=false")
        wait_for(lambda: kube.get("specrl.io/v1alpha1/rljobs", "default", "tiny-local") is None, 20,
              "kopf to release the finalizer")
        wait_for(lambda: not kube.list("v1/configmaps", "default"), 5, "garbage collection of the owned ConfigMap")
        counts = kube.request_counts()
        assert counts[("PATCH", "/apis/specrl.io/v1alpha1/namespaces/default/rljobs/tiny-local")] >= 1
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        print((tmp_path / "kopf.log").read_text()[-4000:])


def test_kubectl_get_watch_streams_status_changes(kube, kubectl, kube_env):
    kubectl("--validate=false", "apply", "-f", "examples/tiny-local.yaml")
    watch = subprocess.Popen([kubectl.binary, "get", "rlj", "-w"], env=kube_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(kube.request_counts()) and any(m == "WATCH" for m, _p in kube.request_counts()), 10,
              "kubectl to start watching")
        kube.patch("specrl.io/v1alpha1/rljobs", "default", "tiny-local", {"status": {"phase": "Running", "step": 2}},
                   subresource="status")
        time.sleep(0.5)
    finally:
        watch.terminate()
        out, err = watch.communicate(timeout=10)
    rows = [line.split() for line in out.splitlines()[1:]]
    assert ["tiny-local", "Running", "2"] == rows[-1][:3], (out, err)
