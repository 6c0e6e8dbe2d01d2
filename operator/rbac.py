"""The Kubernetes API calls the operator makes, as RBAC rules (the Helm chart's ClusterRole mirrors them).

Verbs per resource and who needs them:

* ``specrl.io`` ``rljobs``: get, list, watch (kopf serves them), patch (kopf's finalizer);
  ``rljobs/status``: get, patch (status, kopf's progress in status).
* core ``pods``: list, watch (kopf index of each job's pods), create, delete (children, moves, restarts).
* core ``configmaps``: create, patch (``job.yaml``, rewritten on spec updates), delete (job deletion);
  list, watch (an index of the job-level objects: one deleted by hand is recreated on the next tick).
* core ``secrets``: create, get (the coordinator token for ``POST /drain``), delete — never list: a Secret
  deleted by hand is recreated when a drain or a pod needs it.
* core ``services``: create, delete; list, watch (same index as the ConfigMaps).
* core ``nodes`` (cluster): get — only for a pod stuck terminating or in phase Unknown, to tell a lost node.
* core ``events``: create (kopf.event: transitions, rebalances, pod failures).
* ``apiextensions.k8s.io`` ``customresourcedefinitions`` and core ``namespaces``: list, watch (kopf
  discovers the RLJob resource and the namespaces it serves).
* ``kopf.dev`` ``kopfpeerings``/``clusterkopfpeerings``: get, list, watch, patch — only with ``--peering``.
"""

from __future__ import annotations

from typing import Any

RBAC_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["specrl.io"], "resources": ["rljobs"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["specrl.io"], "resources": ["rljobs/status"], "verbs": ["get", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
]

# Only for hot standby (``specrl operator --peering NAME``).
PEERING_RBAC_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings", "clusterkopfpeerings"],
     "verbs": ["get", "list", "watch", "patch"]},
]
