"""How the agent talks to the API server: the official `kubernetes` client's credentials and connections,
its raw requests, the JSON of the answers, watches as streams of events, and HTTP statuses as errors.

The client loads the credentials (a kubeconfig with its contexts, exec plugins, auth providers,
proxies and TLS server names, or the pod's ServiceAccount, whose rotated token it reads again) and
keeps the connections (urllib3). The requests go through its raw `call_api` and the JSON is read into
frozen values by the modules of each API group: no generated models. This is the one module that
imports `kubernetes`, and only when a client is made, so `sharing plan` and `sharing validate` never
load it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from sharing import __version__
from sharing.errors import KubeError
from sharing.kube.api import (
    ConflictError,
    ForbiddenError,
    GoneError,
    NotFoundError,
    RefusedByBudgetError,
    UnreachableError,
    WatchBrokenError,
    WatchEvent,
)
from sharing.text import bounded


class Transport:
    """The requests of a KubeClient, from a kubeconfig file or in-cluster; the API groups' calls sit
    on top of it."""

    def __init__(self, kubeconfig: str | None = None, *, request_timeout_s: float = 10.0) -> None:
        try:
            self._api = _official_client(kubeconfig)
        except Exception as err:
            where = kubeconfig or "the in-cluster service account"
            raise KubeError(f"cannot load Kubernetes credentials from {where}: {err}") from err
        self._timeout = request_timeout_s
        self.requests = 0

    def close(self) -> None:
        """Close the kept-alive connections (watches close their own when they end)."""
        self._api.close()

    def _call(
        self,
        what: str,
        method: str,
        path: str,
        *,
        body: object,
        content_type: str,
        timeout: float | tuple[float, float],
        query: list[tuple[str, str]] | None = None,
    ) -> Any:
        """The client's raw request (its urllib3 response, body not read yet); KubeError if unreachable."""
        self.requests += 1
        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            request = self._api.param_serialize(
                method,
                path,
                query_params=query,
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._api.call_api(*request, _request_timeout=timeout)
        except Exception as err:  # refused, TLS, timeouts (after the retry): the API server is unreachable
            raise UnreachableError(f"{what}: {type(err).__name__}: {bounded(str(err))}") from err
        return response.response

    def _json(
        self,
        what: str,
        method: str,
        path: str,
        body: object = None,
        content_type: str = "application/json",
        *,
        query: list[tuple[str, str]] | None = None,
    ) -> dict[str, Any]:
        response = self._call(
            what, method, path, body=body, content_type=content_type, timeout=self._timeout, query=query
        )
        try:
            raw = response.data
        except Exception as err:  # the connection broke while the answer came
            raise UnreachableError(f"{what}: {type(err).__name__}: {bounded(str(err))}") from err
        if not 200 <= response.status < 300:
            raise _status_error(what, response.status, response.reason, raw)
        try:
            value: dict[str, Any] = json.loads(raw)
        except ValueError as err:
            raise KubeError(f"{what}: unreadable answer: {err}") from err
        return value

    def _watch(
        self, path: str, convert: Any, field_selector: str, resource_version: str, timeout_s: int
    ) -> Iterator[WatchEvent]:
        query = [("watch", "true"), ("timeoutSeconds", str(timeout_s)), ("allowWatchBookmarks", "true")]
        if field_selector:
            query.append(("fieldSelector", field_selector))
        if resource_version:
            query.append(("resourceVersion", resource_version))
        what = f"watch {field_selector or path}"
        timeouts = (self._timeout, timeout_s + self._timeout)
        response = self._call(
            what, "GET", path, body=None, content_type="application/json", timeout=timeouts, query=query
        )
        try:
            if not 200 <= response.status < 300:
                raise _status_error(what, response.status, response.reason, response.data)
            for line in response:  # urllib3 yields the stream line by line: one JSON object each
                if not line.strip():
                    continue
                raw = json.loads(line)
                kind = raw.get("type")
                obj = raw.get("object") or {}
                if kind == "ERROR":
                    message = bounded(str(obj.get("message", obj)))
                    if obj.get("code") == 410:
                        raise GoneError(f"watch expired: {message}")
                    raise KubeError(f"{what} failed: {message}")
                if kind == "BOOKMARK":
                    yield WatchEvent(kind, None, obj.get("metadata", {}).get("resourceVersion", ""))
                elif kind in ("ADDED", "MODIFIED", "DELETED"):
                    converted = convert(obj)
                    yield WatchEvent(kind, converted, converted.resource_version)
        except KubeError:
            raise
        except Exception as err:  # the connection broke, or a torn line
            raise WatchBrokenError(f"{what}: {type(err).__name__}: {bounded(str(err))}") from err
        finally:
            response.release_conn()


def _official_client(kubeconfig: str | None) -> Any:
    """The official client's ApiClient, from a kubeconfig or the pod's ServiceAccount."""
    from kubernetes import client, config  # noqa: PLC0415 - ~17 MB: only the agent pays for it
    from urllib3.util.retry import Retry  # noqa: PLC0415

    configuration = client.Configuration()
    if kubeconfig and not os.path.isfile(kubeconfig):
        raise ValueError("no such file")  # the client would say "No configuration found"
    if kubeconfig:
        config.load_kube_config(
            config_file=kubeconfig, client_configuration=configuration, persist_config=False
        )
    else:
        config.load_incluster_config(client_configuration=configuration)  # refreshes the rotated token
    # A kept-alive connection the API server dropped (it restarted) fails the next request
    # (SSLEOFError, connection reset): send it once more on a new connection, whatever the method.
    # Every write the agent makes may be repeated (merge patches; a second Event or eviction is harmless).
    configuration.retries = Retry(total=1, status=0, redirect=0, allowed_methods=None, raise_on_status=False)
    api = client.ApiClient(configuration)
    api.user_agent = f"gpu-sharing/{__version__}"
    return api


def _status_error(what: str, status: int, reason: str, body: Any) -> KubeError:
    try:
        message = json.loads(body or b"{}").get("message", "")
    except (ValueError, TypeError, AttributeError):
        message = ""
    text = f"{what}: HTTP {status} {bounded(str(reason), 80)}" + (
        f": {bounded(str(message))}" if message else ""
    )
    if status == 429:
        return RefusedByBudgetError(text)
    if status == 410:
        return GoneError(text)
    if status == 404:
        return NotFoundError(text)
    if status == 409:
        return ConflictError(text)
    if status in (401, 403):
        return ForbiddenError(text + " (check the agent's ServiceAccount and RBAC in deploy/)")
    return KubeError(text)
