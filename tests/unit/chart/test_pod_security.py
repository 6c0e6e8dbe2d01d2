"""The restricted Pod Security Standard checker flags each rule it claims to check (so a pass means something)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.integration.chart.chart_support import restricted_violations


def good_pod() -> dict[str, Any]:
    return {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "c",
            "image": "x",
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            "ports": [{"containerPort": 8080}],
        }],
        "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "x"}}],
    }


def test_compliant_pod_passes() -> None:
    assert restricted_violations(good_pod()) == []


def test_container_level_settings_suffice() -> None:
    pod = good_pod()
    pod["securityContext"] = {}
    pod["containers"][0]["securityContext"].update(runAsNonRoot=True, seccompProfile={"type": "Localhost",
                                                                                       "localhostProfile": "p"})
    assert restricted_violations(pod) == []


def _mutate(path: str, value: Any) -> dict[str, Any]:
    pod = copy.deepcopy(good_pod())
    *parents, last = path.split(".")
    node: Any = pod
    for key in parents:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return pod


@pytest.mark.parametrize(("path", "value", "needle"), [
    ("hostNetwork", True, "hostNetwork"),
    ("hostPID", True, "hostPID"),
    ("hostIPC", True, "hostIPC"),
    ("volumes", [{"name": "h", "hostPath": {"path": "/"}}], "hostPath"),
    ("volumes", [{"name": "n", "nfs": {"server": "s", "path": "/"}}], "nfs"),
    ("securityContext.runAsNonRoot", KeyError, "runAsNonRoot"),
    ("securityContext.runAsUser", 0, "runAsUser"),
    ("securityContext.seccompProfile", {"type": "Unconfined"}, "seccompProfile"),
    ("securityContext.seccompProfile", KeyError, "seccompProfile"),
    ("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "sysctl"),
    ("securityContext.seLinuxOptions", {"type": "spc_t"}, "seLinux"),
    ("containers.0.securityContext.privileged", True, "privileged"),
    ("containers.0.securityContext.allowPrivilegeEscalation", KeyError, "allowPrivilegeEscalation"),
    ("containers.0.securityContext.allowPrivilegeEscalation", True, "allowPrivilegeEscalation"),
    ("containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]}, "drop must include ALL"),
    ("containers.0.securityContext.capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}, "capabilities.add"),
    ("containers.0.securityContext.runAsNonRoot", False, "runAsNonRoot"),
    ("containers.0.securityContext.runAsUser", 0, "runAsUser"),
    ("containers.0.securityContext.procMount", "Unmasked", "procMount"),
    ("containers.0.securityContext.appArmorProfile", {"type": "Unconfined"}, "appArmor"),
    ("containers.0.ports", [{"containerPort": 80, "hostPort": 80}], "hostPort"),
])
def test_each_violation_is_reported(path: str, value: Any, needle: str) -> None:
    problems = restricted_violations(_mutate(path, value), "Deployment/x")
    assert problems, f"{path}={value!r} should violate the restricted standard"
    assert any(needle in p and p.startswith("Deployment/x") for p in problems), problems


def test_net_bind_service_may_be_added() -> None:
    pod = _mutate("containers.0.securityContext.capabilities", {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]})
    assert restricted_violations(pod) == []


def test_init_containers_are_checked() -> None:
    pod = good_pod()
    pod["initContainers"] = [{"name": "init", "image": "x"}]
    problems = restricted_violations(pod)
    assert any("initContainers[init]" in p for p in problems)


@pytest.mark.parametrize("example", ["tiny-local.yaml", "qwen3-8b-eagle3.yaml", "async-quantized-self.yaml"])
def test_operator_job_pods_are_restricted(example: str) -> None:
    """The pods the operator creates must pass the same check: namespaces enforcing `restricted` admit them."""
    from pathlib import Path

    from specrl.operator import children
    from specrl.runtime.api import load_jobs

    path = Path(__file__).resolve().parents[3] / "examples" / example
    if not path.exists():
        pytest.fail(f"example {example} is missing")
    (job,) = load_jobs(path)
    owner = children.Owner(name=job.metadata.name, namespace="ml", uid="0000")
    desired = children.desired(job, owner, {"trainer": 2, "rollout": 2}, token="t")
    assert desired.pods
    problems = [line for name, pod in desired.pods.items()
                for line in restricted_violations(pod["spec"], f"Pod/{name}")]
    assert not problems, "\n".join(problems)
