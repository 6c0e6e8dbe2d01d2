"""Shared Kubernetes test toolchain: a KMock-based API server emulator, served over HTTP.

Modules
- `tests.kube.emulator.Emulator`: KMock's `KubernetesEmulator` plus the API-server behaviour kopf, kubectl
  and helm need (uid/creationTimestamp/generation/resourceVersion, list kinds, selectors, watch resume,
  patch types, status subresource, finalizers, ownerReference GC, CRD registration and schema/CEL
  validation, server-side tables for `kubectl get`). See its module docstring for the full list.
- `tests.kube.server.KubeServer`: runs the emulator on 127.0.0.1:<free port> in a background thread, so
  subprocesses (kopf, kubectl, helm) can talk to it; thread-safe helpers `create/get/list/patch/delete`,
  `write_kubeconfig(path)`, and request accounting `requests()`, `request_counts()`, `mark()`/`requests_since()`.
- `tests.kube.schema.CRDSchema`: kube-apiserver admission of a custom resource from its CRD (pruning,
  defaults, openAPIV3Schema, CEL rules).
- `tests.kube.kubectl.Kubectl`: the real kubectl binary bound to a kubeconfig.

Fixtures (tests/conftest.py)
- `kube`: a started `KubeServer` with the RLJob CRD installed (fresh per test, ~0.5 s).
- `kubeconfig`: path of a kubeconfig pointing at `kube` (namespace `default`).
- `kube_env`: `os.environ` plus `KUBECONFIG` (and a private kubectl cache dir), for subprocesses such
  as `specrl operator` or `kopf run`.
- `kubectl`: `kubectl("get", "rlj", "-o", "json")` -> CompletedProcess (raises on a non-zero exit unless
  `check=False`); `kubectl.json("get", "rlj")` parses `-o json` output.

Example
    def test_operator_creates_pods(kube, kubectl, kube_env):
        kubectl("apply", "--validate=false", "-f", "examples/tiny-local.yaml")
        ...  # start `specrl operator` with env=kube_env, then poll kube.list("v1/pods", "default")
        assert kube.request_counts()[("GET", "/api/v1/namespaces/default/pods")] < 10

To play the kubelet, change a pod's status: `kube.patch("v1/pods", "default", name, {"status": {"phase":
"Running"}}, subresource="status")`. To inject an API failure, add a KMock reaction, which takes precedence
over the emulator: `kube.emulator["post /api/v1/namespaces/default/pods"] << 403`.
"""
