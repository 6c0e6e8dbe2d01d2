"""The Kubernetes API calls the operator makes, as RBAC rules (the Helm chart's ClusterRole mirrors them).

Verbs per resource and who needs them:

* ``specrl.io`` ``rljobs``: get, list, watch (kopf serves them), patch (kopf's finalizer);
  ``rljobs/status``: get, patch (status, kopf's progress in status);
  ``rljobs/finalizers``: update — every child carries an ownerReference with ``blockOwnerDeletion: true``,
  which the OwnerReferencesPermissionEnforcement admission plugin (OpenShift's default) allows only to those
  who may update the owner's finalizers: without it every child create fails with 422.
* core ``pods``: list, watch (kopf index of each job's pods), create, delete (children, moves, restarts).
* core ``configmaps``: create, patch (``job.yaml``, rewritten on spec updates), delete (job deletion);
  list, watch (an index of the job-level objects: one deleted by hand is recreated on the next tick).
* core ``secrets``: create, get (the coordinator token for ``POST /drain``), delete — never list: a Secret
  deleted by hand is recreated when a drain or a pod needs it.
* core ``services``: create, delete; list, watch (same index as the ConfigMaps).
* core ``nodes`` (cluster): get — only for a pod stuck terminating or in phase Unknown, to tell a lost node.
* core ``events``: create (kopf.event: transitions, rebalances, pod failures).
* ``apiextensions.k8s.io`` ``customresourcedefinitions``: list, watch (kopf discovers the RLJob resource).
* core ``namespaces`` (cluster): list, watch — only with ``--namespace``: kopf lists and watches namespaces to
  find the ones it serves unless it runs cluster-wide (``--all-namespaces``), where it never reads them.
* ``kopf.dev`` ``kopfpeerings``/``clusterkopfpeerings``: get, list, watch, patch — only with ``--peering``.
"""

from __future__ import annotations

from typing import Any

RBAC_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["specrl.io"], "resources": ["rljobs"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["specrl.io"], "resources": ["rljobs/status"], "verbs": ["get", "patch"]},
    {"apiGroups": ["specrl.io"], "resources": ["rljobs/finalizers"], "verbs": ["update"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch", "create", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
]

# Only for an operator that watches named namespaces (``specrl operator --namespace NS ...``).
WATCHED_NAMESPACES_RBAC_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]

# Only for hot standby (``specrl operator --peering NAME``).
PEERING_RBAC_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings", "clusterkopfpeerings"],
     "verbs": ["get", "list", "watch", "patch"]},
]
