"""Trainer death: what the coordinator does when trainer processes die mid-job. Pure decisions, no Ray.

A trainer can die at any time; the coordinator notices when a call on the trainer group fails (the GRPO step,
the weight sync, a join) and then asks every trainer for its health: alive or not, the weight version it holds,
and whether an update was cut off half-way (`torn`: some but not all optimizer steps of an RL step applied).

The survivors of a data-parallel group hold identical weights, so any consistent survivor can reseed the group:
- a survivor still on version `v` (the step's update never applied: the all-reduce with the dead peer failed
  before the optimizer step) is the source, and the step is trained again on the same samples, which the ledger
  still holds as completed-not-trained, so every prompt is trained exactly once;
- a survivor already on `v + 1` (the all-reduce completed, the peer died after it) holds the full update: the
  step counts as trained;
- no consistent survivor (all dead, or torn): the newest complete checkpoint is loaded into the trainers that
  are left or that replace the dead ones, and the job rolls back to it (ledger included: the steps after the
  checkpoint are rolled out and trained again, each once in the restored ledger); without a trainer to load it
  into the coordinator waits for one (a recreated pod); without a checkpoint the job fails with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Action(str, Enum):
    CONTINUE = "continue"  # reseed from a survivor on version v; a step cut off in training runs again
    APPLIED = "applied"    # reseed from a survivor on v + 1: the step's update is complete
    RESTORE = "restore"    # load the newest complete checkpoint into the trainers left and joining
    WAIT = "wait"          # no trainer left to load the checkpoint into: wait for a replacement to join
    FAIL = "fail"


@dataclass(frozen=True)
class TrainerHealth:
    name: str
    alive: bool
    weight_version: int = -1
    torn: bool = False
    hung: bool = False  # not alive because it did not answer (its process and pod may live on), not because it died


@dataclass(frozen=True)
class Recovery:
    action: Action
    dead: tuple[str, ...]
    source: str | None  # the survivor whose state reseeds the group, or the checkpoint folder
    reason: str


def plan_recovery(health: Sequence[TrainerHealth], version: int, checkpoint: str | None,
                  joining: Sequence[str] = ()) -> Recovery:
    """The recovery for a trainer group whose weights were on `version` when the failed call started.

    `checkpoint` is the newest complete checkpoint (None: there is none); with no trainer left to look on the
    volume, where to look for one. `joining`: the trainers waiting to join (a recreated pod, or a respawned
    actor in local mode).
    """
    dead = tuple(h.name for h in health if not h.alive)
    alive = [h for h in health if h.alive]
    for target, action in ((version + 1, Action.APPLIED), (version, Action.CONTINUE)):
        src = next((h for h in alive if not h.torn and h.weight_version == target), None)
        if src is not None:
            return Recovery(action, dead, src.name, f"{len(dead)} trainer(s) lost ({', '.join(dead) or 'none'}); "
                            f"{src.name} holds version {target}")
    held = ", ".join(f"{h.name}: v{h.weight_version}{' torn' if h.torn else ''}" for h in alive)
    why = ("every trainer died" if not alive else
           f"no surviving trainer holds a consistent version {version} or {version + 1} ({held})")
    if checkpoint is None:
        return Recovery(Action.FAIL, dead, None, f"{why} and there is no complete checkpoint to resume from "
                        "(set spec.checkpoint.path and interval on a volume every trainer mounts)")
    if not alive and not joining:
        return Recovery(Action.WAIT, dead, checkpoint, f"{why}; waiting for a trainer to join to load {checkpoint}")
    return Recovery(Action.RESTORE, dead, checkpoint, f"{why}; resuming from {checkpoint}")
