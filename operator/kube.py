"""A thin asynchronous Kubernetes API client for the operator's own writes (children, status).

kopf is not an API client: it watches and patches the objects it serves. The operator's other calls
go through this client, which reuses the connection info kopf logged in with (service account in a
cluster, kubeconfig elsewhere), so there is one authentication path. Raw JSON dicts in and out —
no generated models, no quantity coercion surprises.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
import tempfile
from collections.abc import Mapping
from typing import Any

import aiohttp

from . import metrics

log = logging.getLogger("specrl.operator.kube")

USER_AGENT = "specrl-operator/0.1"

# kind -> (api prefix, plural); every kind the operator writes.
_KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "Event": ("/api/v1", "events"),
    "Node": ("/api/v1", "nodes"),  # cluster-scoped: pass namespace ""
    "RLJob": ("/apis/specrl.io/v1alpha1", "rljobs"),
}


class ApiError(Exception):
    def __init__(self, status: int, method: str, url: str, text: str) -> None:
        super().__init__(f"{method} {url} -> HTTP {status}: {text[:300]}")
        self.status = status
        # The API server's own sentence (a Status object's message), e.g. "exceeded quota: ...".
        self.message = text[:300]
        try:
            doc = json.loads(text)
            if isinstance(doc, dict) and doc.get("message"):
                self.message = str(doc["message"])[:500]
        except ValueError:
            pass


def _ssl_context(info: Any) -> ssl.SSLContext | bool:
    if not str(info.server).startswith("https"):
        return False
    if getattr(info, "insecure", False):
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif getattr(info, "ca_path", None):
        ctx = ssl.create_default_context(cafile=os.fspath(info.ca_path))
    elif getattr(info, "ca_data", None):
        data = info.ca_data
        text = data.decode() if isinstance(data, bytes) else data
        if "BEGIN CERTIFICATE" not in text:
            text = base64.b64decode(text).decode()
        ctx = ssl.create_default_context(cadata=text)
    else:
        ctx = ssl.create_default_context()
    cert = getattr(info, "certificate_path", None)
    key = getattr(info, "private_key_path", None)
    cert_data = getattr(info, "certificate_data", None)
    key_data = getattr(info, "private_key_data", None)
    if cert_data and key_data:  # ssl wants files: write them privately
        tmp = tempfile.mkdtemp(prefix="specrl-kube-")
        cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, blob in ((cert, cert_data), (key, key_data)):
            raw = blob if isinstance(blob, bytes) else blob.encode()
            if b"-----BEGIN" not in raw:
                raw = base64.b64decode(raw)
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(raw)
    if cert and key:
        ctx.load_cert_chain(os.fspath(cert), os.fspath(key))
    return ctx


class KubeClient:
    """Create, delete and patch namespaced objects; 409 on create and 404 on delete are not errors."""

    def __init__(self, info: Any, timeout: float = 15.0) -> None:
        self._info = info
        self._server = str(info.server).rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()

    def _headers(self) -> dict[str, str]:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        as_headers = getattr(self._info, "as_http_headers", None)
        if as_headers is not None:
            headers.update(as_headers())
        return headers

    async def session(self) -> aiohttp.ClientSession:
        async with self._lock:
            if self._session is None or self._session.closed:
                connector = aiohttp.TCPConnector(ssl=_ssl_context(self._info), limit=32)
                self._session = aiohttp.ClientSession(
                    connector=connector, timeout=self._timeout, headers=self._headers()
                )
            return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def url(self, kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        prefix, plural = _KINDS[kind]
        url = f"{self._server}{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{self._server}{prefix}/{plural}"
        if name:
            url += f"/{name}"
        if subresource:
            url += f"/{subresource}"
        return url

    async def _request(
        self, method: str, url: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        session = await self.session()
        kwargs: dict[str, Any] = {}
        if body is not None:
            kwargs["json"] = body
            kwargs["headers"] = {"Content-Type": content_type}
        try:
            async with session.request(method, url, **kwargs) as resp:
                text = await resp.text()
                metrics.count_api_request(method, resp.status)
                if resp.status >= 400:
                    raise ApiError(resp.status, method, url, text)
                try:
                    return resp.status, (await resp.json(content_type=None)) if text else None
                except ValueError:
                    return resp.status, text
        except (aiohttp.ClientError, asyncio.TimeoutError):
            metrics.count_api_request(method, 0)  # no HTTP response at all
            raise

    async def create(self, obj: Mapping[str, Any]) -> bool:
        """Create; False when it already exists (names are deterministic, so that is never a duplicate)."""
        meta = obj["metadata"]
        try:
            await self._request("POST", self.url(obj["kind"], meta["namespace"]), dict(obj))
            return True
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise

    async def delete(self, kind: str, namespace: str, name: str, grace_seconds: int | None = None) -> bool:
        """Delete; False when it was already gone."""
        body = None
        if grace_seconds is not None:
            body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": grace_seconds,
                    "propagationPolicy": "Background"}
        try:
            await self._request("DELETE", self.url(kind, namespace, name), body)
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return (await self._request("GET", self.url(kind, namespace, name)))[1]
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def patch(self, kind: str, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        await self._request("PATCH", self.url(kind, namespace, name), dict(body),
                            content_type="application/merge-patch+json")

    async def patch_status(self, kind: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        await self._request(
            "PATCH",
            self.url(kind, namespace, name, "status"),
            {"status": dict(status)},
            content_type="application/merge-patch+json",
        )


_client: KubeClient | None = None


def set_client(client: KubeClient | None) -> None:
    global _client
    _client = client


def client() -> KubeClient:
    if _client is None:
        raise RuntimeError("the Kubernetes client is not logged in yet (the kopf login handler sets it)")
    return _client
