"""What each held slice used over the last `usage.window`, in bounded memory (pure).

Per held slice (its holder's namespace, pod and container, its resource and device ID): when it was
first seen held, when a process of its holder was last seen on it (how long it has been idle), and
one bucket per hour of the window with the peak memory of the hour and a histogram of its SM
samples (20 bins of 5 %; 100 % in the last). A slice costs at most `window / 1 h + 1` buckets of 21
numbers, whatever the sampling interval, and is forgotten once no pod holds it. From these: the
peak memory over the window, and the SM p95 as the upper edge of the bin where 95 % of the samples
are reached (an estimate at most 5 % above the true p95, never below). The sampler keeps them in the
agent's state directory across restarts (`sharing.usage.store`), with whether the slice's idle Event
was said.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from sharing.usage.attribute import HeldSlice, SliceUse

BUCKET_SECONDS = 3600
SM_BINS = 20


@dataclass(frozen=True, slots=True, order=True)
class SliceKey:
    """A held slice, by who holds it and what it is."""

    namespace: str
    pod: str
    container: str
    resource: str
    device: str


def key_of(held: HeldSlice) -> SliceKey:
    return SliceKey(held.namespace, held.pod, held.container, held.resource, held.device)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One hour of a slice's use."""

    start: int
    """Unix time of the hour's start (a multiple of BUCKET_SECONDS)."""
    peak_bytes: int
    sm: tuple[int, ...]
    """SM_BINS counts of the samples whose SM share was known."""


@dataclass(frozen=True, slots=True)
class History:
    """One held slice over the window."""

    first_held: float
    last_active: float | None = None
    """When a process of its holder was last seen on it; None: never since it was first held."""
    buckets: tuple[Bucket, ...] = ()
    idle_said: bool = False
    """Its `SliceIdle` Event was recorded (once per pod and slice: `sharing.usage.idle`)."""

    def idle_seconds(self, now: float) -> float:
        """How long no process of its holder has run on it (since it was held, if never)."""
        since = self.last_active if self.last_active is not None else self.first_held
        return max(0.0, now - since)

    def within(self, now: float, window_s: float) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if b.start + BUCKET_SECONDS > now - window_s)

    def peak_bytes(self, now: float, window_s: float) -> int | None:
        """The most memory it used in the window; None before its first sample."""
        found = self.within(now, window_s)
        return max(b.peak_bytes for b in found) if found else None

    def sm_p95(self, now: float, window_s: float) -> float | None:
        """The upper edge of the SM bin where 95 % of the window's samples are reached (0..1); None
        without a sample whose SM share was known."""
        counts = [sum(column) for column in zip(*(b.sm for b in self.within(now, window_s)), strict=True)]
        total = sum(counts)
        if total == 0:
            return None
        wanted, seen = math.ceil(0.95 * total), 0
        for i, count in enumerate(counts):
            seen += count
            if seen >= wanted:
                return (i + 1) / SM_BINS
        return 1.0

    def samples(self, now: float, window_s: float) -> int:
        """How many samples with a known SM share the window holds."""
        return sum(sum(b.sm) for b in self.within(now, window_s))


def sm_bin(share: float) -> int:
    """The histogram bin of an SM share (0..1)."""
    return min(SM_BINS - 1, max(0, int(share * SM_BINS)))


def record(
    histories: Mapping[SliceKey, History], uses: Sequence[SliceUse], now: float, window_s: float
) -> dict[SliceKey, History]:
    """The histories after one sample of every held slice: a slice no longer held is forgotten,
    buckets older than the window are dropped."""
    start = int(now // BUCKET_SECONDS) * BUCKET_SECONDS
    updated: dict[SliceKey, History] = {}
    for use in uses:
        key = key_of(use.held)
        history = histories.get(key) or History(first_held=now)
        if use.processes:
            history = replace(history, last_active=now)
        buckets = list(history.within(now, window_s))
        if not buckets or buckets[-1].start != start:
            buckets.append(Bucket(start, 0, (0,) * SM_BINS))
        last = buckets[-1]
        sm = list(last.sm)
        if use.sm is not None:
            sm[sm_bin(use.sm)] += 1
        buckets[-1] = Bucket(start, max(last.peak_bytes, use.memory_used_bytes), tuple(sm))
        updated[key] = replace(history, buckets=tuple(buckets))
    return updated
