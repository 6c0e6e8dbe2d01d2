"""The job coordinator, one concept per module:

- `job.py`          JobCoordinator: the step loop (sync/async, the same in local and pod mode) and the HTTP view
- `membership.py`   which pods are workers, who may join
- `placement.py`    where worker actors run (the one place that builds Ray actor options)
- `rollouts.py`     rollout workers, chunk dispatch and collection, failures
- `trainers.py`     the data-parallel trainer group, regrouping, the training batch
- `recovery.py`     what to do when trainers die (reseed from a survivor, or roll back to a checkpoint)
- `weight_sync.py`  trainer rank 0 -> rollout workers, group rebuilds
- `drafter.py`      drafter training in the long tail (TLT)
- `checkpoints.py`  where checkpoints live, which one to resume from
- `records.py`      step records, per-worker metric series
- `shared.py`       the state the parts share (settings, lock, ledger, worker table, metrics)
"""

from .checkpoints import latest_checkpoint, list_checkpoints, prune_checkpoints
from .job import JobCoordinator
from .membership import members_from_nodes
from .placement import Placement, pod_resource, role_resource
from .records import StepRecord, acceptance_length

__all__ = [
    "JobCoordinator", "Placement", "StepRecord", "acceptance_length", "latest_checkpoint", "list_checkpoints",
    "members_from_nodes", "pod_resource", "prune_checkpoints", "role_resource",
]
