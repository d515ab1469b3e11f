"""Watches that turn the Kubernetes world into reconcile triggers: this Node and the ConfigMap.

Each watch is a list-then-watch loop (like a client-go informer) on its own thread, because the
official client blocks. It resumes from the last resource version after a disconnect, lists again
after `410 Gone`, backs off while the API server is unreachable, and hands the newest object to the
event loop. Only changes that matter (the Node's labels, the ConfigMap's data) trigger a reconcile,
so the kubelet's status updates cost nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import structlog

from sharing.errors import KubeError
from sharing.kube import ConfigMapObject, GoneError, KubeClient, NodeObject, WatchEvent

T = TypeVar("T", NodeObject, ConfigMapObject)
log = structlog.get_logger(__name__)
EMPTY_WATCH_PAUSE_S = 0.2


class Watched(Generic[T]):
    """The newest version of one object, kept current by a watch thread."""

    def __init__(
        self,
        what: str,
        get: Callable[[], T],
        watch: Callable[[str], Iterator[WatchEvent]],
        relevant: Callable[[T], object],
        *,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.what = what
        self.current: T | None = None
        self._on_change: Callable[[], None] = lambda: None
        self._get: Callable[[], T] = get
        self._watch: Callable[[str], Iterator[WatchEvent]] = watch
        self._relevant: Callable[[T], object] = relevant
        self._backoff_max_s = backoff_max_s
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, on_change: Callable[[], None]) -> None:
        """Start the watch thread (call from the event loop); `on_change` runs on the loop."""
        self._on_change = on_change
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop; it ends at its next event or watch timeout (it is a daemon)."""
        self._stopped.set()

    def _run(self) -> None:
        version = ""
        delay = 0.0
        while not self._stopped.is_set():
            try:
                if not version:
                    obj = self._get()
                    self._deliver(obj)
                    version = obj.resource_version
                events = 0
                for event in self._watch(version):
                    if self._stopped.is_set():
                        return
                    self._deliver(event.object)  # type: ignore[arg-type]
                    version = event.object.resource_version or version
                    events += 1
                delay = 0.0
                if not events:  # a server that ends watches at once must not make this spin
                    self._stopped.wait(EMPTY_WATCH_PAUSE_S)
            except GoneError:
                log.info("watch_expired", what=self.what)
                version = ""
            except KubeError as err:
                delay = min(self._backoff_max_s, max(0.2, delay * 2))
                log.warning("watch_failed", what=self.what, error=str(err), retry_in_s=delay)
                version = ""  # list again after an outage: what happened meanwhile is in the list
                self._stopped.wait(delay)

    def _deliver(self, obj: T) -> None:
        if self._loop is not None and not self._stopped.is_set():
            self._loop.call_soon_threadsafe(self._store, obj)

    def _store(self, obj: T) -> None:
        before = self.current
        self.current = obj
        if before is None or self._relevant(before) != self._relevant(obj):
            self._on_change()


def watch_node(kube: KubeClient, name: str, timeout_s: int) -> Watched[NodeObject]:
    """This node; its labels select the config."""
    return Watched(
        f"node/{name}",
        lambda: kube.get_node(name),
        lambda version: kube.watch_node(name, version, timeout_s),
        lambda node: node.labels,
    )


def watch_configmap(kube: KubeClient, namespace: str, name: str, timeout_s: int) -> Watched[ConfigMapObject]:
    """The ConfigMap of named configs; a deleted one reads as missing (data None)."""

    def events(version: str) -> Iterator[WatchEvent]:
        for event in kube.watch_configmap(namespace, name, version, timeout_s):
            if event.kind == "DELETED":
                gone = ConfigMapObject(namespace, name, event.object.resource_version, None)
                yield WatchEvent(event.kind, gone)
            else:
                yield event

    return Watched(
        f"configmap/{namespace}/{name}",
        lambda: kube.get_configmap(namespace, name),
        events,
        lambda cm: cm.data,
    )
