"""`helm test` check of a specrl release: the RLJob CRD is Established and the operator answers /healthz.

Runs in the operator image under the operator's ServiceAccount, which may `list` CRDs (kopf needs that), so the
test needs no RBAC of its own. It logs in and talks to the API server the way the operator does (kopf's login,
`specrl.operator.kube`), so the image needs no other Kubernetes client; every failure prints one line naming what
is wrong and exits 1.

Environment: SPECRL_TEST_CRD (CRD name), SPECRL_TEST_HEALTH_URL, SPECRL_TEST_TIMEOUT (seconds).
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request


def crd_established(name: str) -> tuple[bool, str]:
    # The operator's own login (kopf's: service account in a pod, else $KUBECONFIG) and HTTP client.
    import asyncio

    import kopf
    from specrl.operator.kube import KubeClient

    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        return False, "no Kubernetes credentials (no service account token and no kubeconfig)"

    async def list_crds() -> dict:
        kube = KubeClient(info)
        try:
            session = await kube.session()
            url = f"{str(info.server).rstrip('/')}/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
            async with session.get(url) as resp:
                if resp.status >= 400:
                    raise RuntimeError(f"GET {url} -> HTTP {resp.status}")
                return await resp.json(content_type=None)
        finally:
            await kube.close()

    found = asyncio.run(list_crds())
    items = [i for i in (found or {}).get("items") or [] if i.get("metadata", {}).get("name") == name]
    if not items:
        return False, f"CRD {name} not found (install the chart without --skip-crds, or apply crds/)"
    conditions = (items[0].get("status") or {}).get("conditions") or []
    for cond in conditions:
        if cond.get("type") == "Established":
            if cond.get("status") == "True":
                return True, f"CRD {name} is Established"
            return False, f"CRD {name} is not Established: {cond.get('reason')}: {cond.get('message')}"
    return False, f"CRD {name} has no Established condition yet"


def operator_live(url: str) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            if resp.status == 200:
                return True, f"operator is live ({url} -> 200)"
            return False, f"operator liveness {url} -> HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return False, f"operator liveness {url} -> HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"operator liveness {url} unreachable: {getattr(exc, 'reason', exc)}"


def main() -> int:
    crd = os.environ.get("SPECRL_TEST_CRD", "rljobs.specrl.io")
    url = os.environ.get("SPECRL_TEST_HEALTH_URL", "")
    if not url:
        print("SPECRL_TEST_HEALTH_URL is not set", file=sys.stderr)
        return 2
    deadline = time.monotonic() + float(os.environ.get("SPECRL_TEST_TIMEOUT", "120"))
    checks = {"crd": lambda: crd_established(crd), "operator": lambda: operator_live(url)}
    last: dict[str, str] = {}
    while True:
        for key, check in list(checks.items()):
            try:
                ok, message = check()
            except Exception as exc:  # noqa: BLE001 - an API error is a failed attempt, retried until the deadline
                ok, message = False, f"{key} check failed: {type(exc).__name__}: {exc}"
            last[key] = message
            if ok:
                print(f"ok: {message}", flush=True)
                del checks[key]
        if not checks:
            return 0
        if time.monotonic() >= deadline:
            for key in checks:
                print(f"FAIL: {last[key]}", file=sys.stderr)
            return 1
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main())
