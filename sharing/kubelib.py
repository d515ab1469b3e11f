"""The official `kubernetes` client's transport, for a kubeconfig only that client understands.

`sharing.kubehttp` serves in-cluster credentials and kubeconfigs with certificates or tokens; exec
plugins, auth providers and the like are the official client's, so such a kubeconfig goes through
it, with the same surface (`request`, `watch`). It is imported only then: it costs ~17 MB.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sharing import kubehttp


class Library:
    """The official client's transport, for kubeconfigs only it understands (imported only then)."""

    def __init__(self, kubeconfig: str | None) -> None:
        from kubernetes import config  # noqa: PLC0415 - 17 MB: only when nothing else will do

        self._api = config.new_client_from_config(config_file=kubeconfig)

    def request(
        self, method: str, path: str, body: bytes | None, content_type: str, timeout: float
    ) -> tuple[int, str, bytes]:
        response = self._call(method, path, body, content_type, timeout)
        return response.status, str(response.reason), response.read()

    def watch(self, path: str, connect_timeout: float, read_timeout: float) -> LibraryWatch:
        return LibraryWatch(
            self._call("GET", path, None, "application/json", (connect_timeout, read_timeout))
        )

    def close(self) -> None:
        self._api.close()

    def _call(
        self,
        method: str,
        path: str,
        body: bytes | None,
        content_type: str,
        timeout: float | tuple[float, float],
    ) -> Any:
        from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

        headers = {"Accept": "application/json", "Content-Type": content_type}
        try:
            request = self._api.param_serialize(
                method,
                path,
                header_params=headers,
                body=None if body is None else json.loads(body),  # the client serialises it again
                auth_settings=["BearerToken"],
            )
            return self._api.call_api(*request, _request_timeout=timeout)
        except ApiException as err:
            return _Failed(err.status, str(err.reason), err.body or b"")
        except Exception as err:
            raise kubehttp.TransportError(f"{type(err).__name__}: {err}") from err


@dataclass(frozen=True, slots=True)
class _Failed:
    status: int
    reason: str
    raw: bytes | str

    def read(self) -> bytes:
        return self.raw.encode() if isinstance(self.raw, str) else self.raw


class LibraryWatch:
    """A watch over the official client: the same surface as `kubehttp.Watch`."""

    def __init__(self, response: Any) -> None:
        self._response = response
        self.status, self.reason = response.status, str(response.reason)

    def body(self) -> bytes:
        return bytes(self._response.read())

    def lines(self) -> Iterator[bytes]:
        if isinstance(self._response, _Failed):
            return
        try:
            yield from _lines(self._response.response.stream(amt=None, decode_content=True))
        except Exception as err:
            raise kubehttp.TransportError(f"{type(err).__name__}: {err}") from err

    def close(self) -> None:
        if not isinstance(self._response, _Failed):
            self._response.response.release_conn()


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Whole lines out of a stream of chunks (a watch sends one JSON object per line)."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        yield from (line for line in complete if line.strip())
    if pending.strip():
        yield pending
