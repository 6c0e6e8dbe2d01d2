"""HTTP client for a job's coordinator (DESIGN §3): ``GET /status`` and ``POST /drain``.

Every call has a short timeout; repeated failures back off exponentially per job (the timer keeps
ticking, but polls are skipped until the backoff expires), so an unreachable coordinator costs little.
The caller marks the job Degraded and makes no moves while the coordinator cannot be read.

``GET /status`` is external input: it is validated with :class:`CoordinatorStatus` (types, finite numbers,
bounds) before anything reads it, so a buggy or hostile coordinator can neither crash the reconcile nor put
NaN or an out-of-range number into the RLJob status (the API server would then refuse every status patch).
A response that fails validation raises :class:`InvalidStatus`, handled like an unreachable coordinator.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

DEFAULT_TIMEOUT = 3.0
MAX_BACKOFF = 60.0


class CoordinatorError(Exception):
    """The coordinator could not be reached or answered with something unusable."""


class InvalidStatus(CoordinatorError):
    """The coordinator answered, but ``GET /status`` is not a valid status document."""


# JSON integers an RLJob status can hold without surprises (exactly representable as float64).
MAX_COUNT = 2**53
MAX_RATE = 1e12


class _Doc(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class WorkerStatus(_Doc):
    name: str = Field(max_length=253)
    role: str = Field(default="", max_length=64)
    state: str = Field(default="active", max_length=64)


class StepTimings(_Doc):
    rollout_seconds: float = Field(ge=0, le=MAX_RATE, allow_inf_nan=False)
    long_tail_seconds: float = Field(default=0.0, ge=0, le=MAX_RATE, allow_inf_nan=False)
    train_seconds: float = Field(ge=0, le=MAX_RATE, allow_inf_nan=False)


class CoordinatorStatus(_Doc):
    """The part of the coordinator's ``GET /status`` (DESIGN §3) the operator reads; other keys are ignored."""

    step: int = Field(default=0, ge=0, le=MAX_COUNT)
    weight_version: int = Field(default=0, ge=0, le=MAX_COUNT)
    phase: str = Field(default="Rollout", max_length=64)
    queue_depth: int = Field(default=0, ge=0, le=MAX_COUNT)
    active_sequences: int = Field(default=0, ge=0, le=MAX_COUNT)
    step_batch_size: int = Field(default=0, ge=0, le=MAX_COUNT)
    trainer_backlog: int = Field(default=0, ge=0, le=MAX_COUNT)
    long_tail: bool = False
    complete: bool = False
    spec_decode_enabled: bool = False
    tokens_per_second: float = Field(default=0.0, ge=0, le=MAX_RATE, allow_inf_nan=False)
    acceptance_length: float | None = Field(default=None, ge=0, le=1e6, allow_inf_nan=False)
    workers: list[WorkerStatus] = Field(default_factory=list, max_length=100_000)
    last_step: StepTimings | None = None

    @classmethod
    def parse(cls, data: Any, where: str) -> dict[str, Any]:
        """The validated document as camelCase JSON (what :class:`rebalance.Signals` reads), or InvalidStatus."""
        if not isinstance(data, dict):
            raise InvalidStatus(f"{where} returned {type(data).__name__}, not a JSON object")
        try:
            doc = cls.model_validate({k: v for k, v in data.items() if v is not None})
        except ValidationError as exc:
            err = exc.errors()[0]
            path = ".".join(str(x) for x in err["loc"]) or "(document)"
            raise InvalidStatus(f"{where}: invalid status: {path}: {err['msg']} "
                                f"(got {str(err.get('input'))[:40]!r})") from None
        return doc.model_dump(by_alias=True)


def _error_of(body: str) -> str:
    """The coordinator's reason from an error body (`{"error": "..."}`), one bounded line; else ""."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    err = data.get("error") if isinstance(data, dict) else None
    return " ".join(str(err).split())[:300] if err else ""


class DrainRejected(CoordinatorError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Health:
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""


class CoordinatorClient:
    def __init__(self, url_template: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.url_template = url_template
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=min(timeout, 2.0))
        self._session: aiohttp.ClientSession | None = None
        self._health: dict[tuple[str, str], _Health] = {}

    def base_url(self, namespace: str, name: str) -> str:
        return self.url_template.format(name=name, namespace=namespace).rstrip("/")

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers={"User-Agent": "specrl-operator/0.1"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def backing_off(self, namespace: str, name: str, now: float | None = None) -> str | None:
        """The last error while the backoff window is open, else None."""
        h = self._health.get((namespace, name))
        if h and h.failures and (now if now is not None else time.monotonic()) < h.retry_at:
            return h.last_error
        return None

    def forget(self, namespace: str, name: str) -> None:
        self._health.pop((namespace, name), None)

    def _failed(self, key: tuple[str, str], error: str) -> None:
        h = self._health.setdefault(key, _Health())
        h.failures += 1
        h.last_error = error
        h.retry_at = time.monotonic() + min(MAX_BACKOFF, 2.0 ** (h.failures - 1))

    async def status(self, namespace: str, name: str) -> dict[str, Any]:
        key = (namespace, name)
        url = f"{self.base_url(namespace, name)}/status"
        try:
            sess = await self._sess()
            async with sess.get(url) as resp:
                if resp.status != 200:
                    raise CoordinatorError(f"GET {url} -> HTTP {resp.status}")
                data = await resp.json(content_type=None)
            data = CoordinatorStatus.parse(data, f"GET {url}")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            err = f"GET {url}: {type(exc).__name__}: {exc}".rstrip(": ")
            self._failed(key, err)
            raise CoordinatorError(err) from exc
        except CoordinatorError as exc:
            self._failed(key, str(exc))
            raise
        self._health.pop(key, None)
        return data

    async def drain(self, namespace: str, name: str, worker: str, token: str) -> str:
        """Ask the coordinator to retire ``worker``; returns its state, ``"gone"`` when unknown (404)."""
        url = f"{self.base_url(namespace, name)}/drain"
        try:
            sess = await self._sess()
            async with sess.post(url, json={"worker": worker}, headers={"Authorization": f"Bearer {token}"}) as resp:
                if resp.status == 404:
                    return "gone"
                if resp.status == 401:
                    raise DrainRejected(401, f"POST {url}: coordinator rejected the job's token (401)")
                if resp.status not in (200, 202):
                    why = _error_of(await resp.text())
                    raise DrainRejected(resp.status, f"POST {url} -> HTTP {resp.status}" + (f": {why}" if why else ""))
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise CoordinatorError(f"POST {url}: {type(exc).__name__}: {exc}") from exc
        return str((data or {}).get("state", "draining"))
