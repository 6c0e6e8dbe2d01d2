"""What every part of the coordinator shares: the settings, one lock, the prompt ledger, the worker table and
the metric series. The HTTP thread reads it under `lock` while the step loop changes it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ..rl.settings import RunSettings
from ..scheduling import PromptLedger, WorkerTable
from .records import WorkerSeries


@dataclass
class Shared:
    settings: RunSettings
    cm: Any  # the coordinator's own RuntimeMetrics (role "coordinator")
    series: WorkerSeries
    lock: threading.RLock = field(default_factory=threading.RLock)
    ledger: PromptLedger = field(default_factory=PromptLedger)
    table: WorkerTable = field(default_factory=WorkerTable)
