"""Watches that turn the Kubernetes world into reconcile triggers: this Node and the ConfigMaps (and
nothing of other nodes: no ResourceClaim is watched, `sharing.kube.podclaims`).

Each watch runs on its own thread, because the official client blocks. It reads the object once
(a missing ConfigMap reads as "no data"), then watches from the newest state (no resource
version: the server sends the object as it is now, then every change), resumes from the last
version it saw (events and bookmarks) after a broken connection, starts again from the newest state
after `410 Gone`, and backs off on repeated failures of any kind (to at most a second while the
API server does not answer at all, so the watches are back soon after it restarts). Starting from
the object's own resource version would be wrong: an object unchanged for a while is older than
the server's watch window (always so after an API server restart), and every watch from it would
end in 410.
An API server that has just started answers for a moment with 401 or 403: its authorizer reads the
RBAC objects through informers (k8s.io/kubernetes pkg/kubeapiserver/authorizer/config.go, rbac.New
over the Roles' and ClusterRoles' listers) and denies until they have loaded; a bench run saw 403s
0.55 s after a restart. So after a connection loss (and at start) a refusal is retried like no
answer at all, at most a second apart, `AUTH_RETRIES` times; one that persists is said once, by
name, as what it then is: the ServiceAccount's RBAC, and backs off to the maximum.
Only changes that matter (the Node's labels, the ConfigMap's data) trigger a reconcile, so the
kubelet's status updates cost nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import structlog

from sharing.errors import KubeError
from sharing.kube.api import (
    ConfigMapObject,
    ForbiddenError,
    GoneError,
    KubeClient,
    NodeObject,
    UnreachableError,
    WatchEvent,
)
from sharing.text import bounded

T = TypeVar("T", NodeObject, ConfigMapObject)
log = structlog.get_logger(__name__)
EMPTY_WATCH_PAUSE_S = 0.2
BACKOFF_MIN_S = 0.2
UNREACHABLE_BACKOFF_MAX_S = 1.0
"""While nothing answers (the API server is down or restarting), try again at least every second: a
refused connection costs the server nothing, and the watches are back within a second of it."""
AUTH_RETRIES = 30
"""Refusals (401, 403) after a connection loss or at start retried at most a second apart: a
starting API server denies until its RBAC data has loaded (about a second on 2 loaded cores)."""


@dataclass(slots=True)
class _Retry:
    """When a watch is tried again, from what the attempts since the last one that worked got."""

    longest_s: float
    waits: int = 0
    gone: bool = False
    """A 410 came since the last watch that worked."""
    silent: bool = False
    """The last attempt got no answer at all (the API server is down or restarting)."""
    refusals: int = 0
    """401s and 403s since the last connection loss (or the start)."""

    def served(self) -> None:
        """A watch works: failures start over, and a refusal from now on is about permissions."""
        self.waits, self.gone, self.silent, self.refusals = 0, False, False, AUTH_RETRIES

    def expired(self) -> float:
        """A 410. The server answered, so an outage before (an API server restart) is over: the first
        410 waits nothing and the backoff starts again from its minimum; only another 410 before a
        watch works waits."""
        self.silent = False
        if self.gone:
            return self._next(self.longest_s)
        self.waits, self.gone = 0, True
        return 0.0

    def unanswered(self) -> float:
        """No answer: tried again at least every second, and refusals after it retried fast again."""
        self.silent, self.refusals = True, 0
        return self._next(UNREACHABLE_BACKOFF_MAX_S)

    def refused(self) -> float:
        """A 401 or 403: at most a second apart while the server may still be loading RBAC."""
        self.answered_after_silence()
        self.refusals += 1
        return self._next(UNREACHABLE_BACKOFF_MAX_S if self.refusals <= AUTH_RETRIES else self.longest_s)

    def answered(self) -> float:
        """Another error the server answered: back off up to the maximum."""
        self.answered_after_silence()
        return self._next(self.longest_s)

    def failed(self) -> float:
        """A failure of our own (a bug, a surprise from the client): back off up to the maximum."""
        return self._next(self.longest_s)

    def answered_after_silence(self) -> None:
        if self.silent:  # the outage's backoff is over
            self.waits, self.silent = 0, False

    def _next(self, longest: float) -> float:
        pause = float(min(longest, BACKOFF_MIN_S * 2**self.waits))
        self.waits = min(self.waits + 1, 16)
        return pause


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
        pause: Callable[[float], object] | None = None,
    ) -> None:
        self.what = what
        self.current: T | None = None
        self._on_change: Callable[[], None] = lambda: None
        self._get: Callable[[], T] = get
        self._watch: Callable[[str], Iterator[WatchEvent]] = watch
        self._relevant: Callable[[T], object] = relevant
        self._backoff_max_s = backoff_max_s
        self._stopped = threading.Event()
        self._pause: Callable[[float], object] = pause or self._stopped.wait
        """Waits between attempts (returns early when stopped); tests record the delays instead."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._delivered = asyncio.Event()
        """Set (and replaced) on each version delivered: what `until` waits on."""

    def start(self, on_change: Callable[[], None]) -> None:
        """Start the watch thread (call from the event loop); `on_change` runs on the loop."""
        self._on_change = on_change
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to stop; it ends at its next event or watch timeout (it is a daemon)."""
        self._stopped.set()

    async def until(self, predicate: Callable[[T], bool], timeout: float) -> T | None:
        """The newest version once `predicate` holds for it (looked at again on every version the
        watch delivers, relevant or not); None when it does not within `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.current is None or not predicate(self.current):
                    await self._delivered.wait()
                return self.current
        return None

    def _run(self) -> None:
        read = False
        version = ""
        retry = _Retry(self._backoff_max_s)
        while not self._stopped.is_set():
            try:
                if not read:
                    self._deliver(self._get())
                    read = True
                events = 0
                for event in self._watch(version):
                    if self._stopped.is_set():
                        return
                    retry.served()
                    if event.object is not None:
                        self._deliver(event.object)  # type: ignore[arg-type]
                    version = (
                        event.resource_version or getattr(event.object, "resource_version", "") or version
                    )
                    events += 1
                retry.served()
                if not events:  # a server that ends watches at once must not make this spin
                    self._pause(EMPTY_WATCH_PAUSE_S)
                continue
            except GoneError:
                # Our version left the server's window: watch from the newest state, which the
                # server sends first.
                log.info("watch_expired", what=self.what)
                version = ""
                pause = retry.expired()
            except UnreachableError as err:
                log.warning("watch_failed", what=self.what, error=bounded(str(err)))
                pause = retry.unanswered()
            except ForbiddenError as err:
                pause = retry.refused()
                if retry.refusals <= AUTH_RETRIES:  # the server may still be loading who may do what
                    log.info("watch_refused", what=self.what, error=bounded(str(err)), attempt=retry.refusals)
                elif retry.refusals == AUTH_RETRIES + 1:
                    log.error(
                        "watch_forbidden",
                        what=self.what,
                        error=bounded(str(err)),
                        why="the API server keeps refusing: the agent's ServiceAccount lacks the RBAC"
                        " permission (its ClusterRole in deploy/ or the chart) or its token is not valid",
                    )
            except KubeError as err:  # the server answered with an error: back off up to the maximum
                log.warning("watch_failed", what=self.what, error=bounded(str(err)))
                pause = retry.answered()
            except Exception as err:  # a bug or a surprise from the client must not end the watch
                log.error("watch_crashed", what=self.what, error=f"{type(err).__name__}: {bounded(str(err))}")
                read, version = False, ""
                pause = retry.failed()
            if pause:
                self._pause(pause)

    def _deliver(self, obj: T) -> None:
        if self._loop is not None and not self._stopped.is_set():
            self._loop.call_soon_threadsafe(self._store, obj)

    def _store(self, obj: T) -> None:
        before = self.current
        self.current = obj
        delivered, self._delivered = self._delivered, asyncio.Event()
        delivered.set()
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
    """A ConfigMap of named configs; a deleted or missing one reads as no data (data None)."""

    def events(version: str) -> Iterator[WatchEvent]:
        for event in kube.watch_configmap(namespace, name, version, timeout_s):
            if event.kind == "DELETED":
                gone = ConfigMapObject(namespace, name, event.resource_version, None)
                yield WatchEvent(event.kind, gone, event.resource_version)
            else:
                yield event

    return Watched(
        f"configmap/{namespace}/{name}",
        lambda: kube.get_configmap(namespace, name),
        events,
        lambda cm: cm.data,
    )
