"""Where the node's configs come from: the user's ConfigMap over the shipped presets, and the last good.

Presets live in their own ConfigMap (`gpu-sharing-presets`, replaced on every upgrade); users own
theirs (`gpu-sharing-config`, never overwritten). Both are watched; each is parsed on its own (in a
thread: a large ConfigMap takes seconds, and the loop serves gRPC meanwhile), so a broken key in one
spoils nothing in the other, and a name the user defines (valid or not) wins over a preset of the
same name. The config last applied is kept on disk (`sharing.store.memory`) for a start without the API.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from sharing.config import CONFIGMAP, ConfigSet, MigStrategy, Problem, SharingConfig, parse_configmap
from sharing.kube.api import ConfigMapObject, KubeClient
from sharing.kube.watch import Watched, watch_configmap
from sharing.mig import Catalog
from sharing.model import Gpu, NodeState
from sharing.store import LastGood, LastGoodError, Remembered
from sharing.text import bounded

log = structlog.get_logger(__name__)


def merge(user: ConfigSet, presets: ConfigSet) -> ConfigSet:
    """The configs a node can select: the user's, then the presets the user does not redefine.

    A user ConfigMap broken as a whole (e.g. over 1 MiB) hides every preset too: which names it
    defines cannot be told, and falling back to a preset of the same name would be a guess.
    """
    if CONFIGMAP in user.invalid:
        return user
    owned = set(user.names) | set(user.invalid)
    kept_invalid = tuple(n for n in presets.invalid if n not in owned and n != CONFIGMAP)
    return ConfigSet(
        configs=user.configs + tuple(c for c in presets.configs if c.name not in owned),
        errors=user.errors + tuple(p for p in presets.errors if p.config in kept_invalid),
        warnings=user.warnings + tuple(p for p in presets.warnings if p.config not in owned),
        invalid=user.invalid + kept_invalid,
    )


def per_config(problems: Sequence[Problem]) -> dict[str, list[Problem]]:
    """{config name: its problems}, in the order they were found."""
    found: dict[str, list[Problem]] = {}
    for p in problems:
        found.setdefault(p.config, []).append(p)
    return found


class ConfigSources:
    """The watched ConfigMaps (the user's first), their parsed configs, and the last good config."""

    def __init__(
        self,
        kube: KubeClient,
        catalog: Catalog,
        *,
        namespace: str,
        names: Sequence[str],
        watch_timeout_seconds: int,
        last_good: Path,
        default_mig_strategy: MigStrategy,
    ) -> None:
        """Watch the ConfigMaps `names` (the user's first; an empty name is skipped) in `namespace`."""
        self.watches: list[Watched[ConfigMapObject]] = [
            watch_configmap(kube, namespace, name, watch_timeout_seconds) for name in names if name
        ]
        self.memory = LastGood(last_good)
        self._catalog = catalog
        self._strategy = default_mig_strategy
        self._parsed: list[tuple[object, ConfigSet]] = []  # per ConfigMap: (what it was parsed from, configs)
        self._merged: ConfigSet | None = None
        self.invalid_presets: frozenset[str] = frozenset()
        """Invalid keys of the presets ConfigMap the user's does not redefine: a shipped preset that does
        not fit this node's GPUs (MIG on an L4) is no error of the user's unless the node selects it."""

    def start(self, on_change: Callable[[], None]) -> None:
        """Start watching (from the event loop)."""
        for watched in self.watches:
            watched.start(on_change)

    def stop(self) -> None:
        """Stop watching."""
        for watched in self.watches:
            watched.stop()

    @property
    def missing(self) -> list[str]:
        """The ConfigMaps not read yet (a missing ConfigMap reads as empty, not as not read)."""
        return [w.what for w in self.watches if w.current is None]

    async def configs(self, observed: NodeState) -> ConfigSet:
        """The configs; a ConfigMap is parsed again only when it or the node's GPUs changed (an edit
        of the user's does not parse the presets again)."""
        hardware = tuple(
            (g.index, g.product, g.pci_device_id, g.pci_subsystem_id, g.profiles) for g in observed.gpus
        )
        changed = self._merged is None
        for i, watched in enumerate(self.watches):
            current = watched.current
            key = ((current.resource_version, current.data is None) if current else None, hardware)
            if i < len(self._parsed) and self._parsed[i][0] == key:
                continue
            text = dict(current.data or {}) if current else {}
            parsed = (key, await asyncio.to_thread(self._parse_one, text, observed.gpus))
            self._parsed[i:i + 1] = [parsed]  # fmt: skip
            changed = True
        if changed or self._merged is None:
            sets = [configs for _, configs in self._parsed]
            self._merged = merge(sets[0], sets[1]) if len(sets) > 1 else sets[0]
            self.invalid_presets = frozenset(self._merged.invalid) - frozenset(sets[0].invalid)
            # Said once per change of the ConfigMaps (or of the GPUs): every warning, one line per config
            # (the presets warn on every node about rules for GPUs it lacks; a user's own stand apart).
            for name, found in per_config(self._merged.warnings).items():
                shown = [bounded(f"{w.path}: {w.message}" if w.path else w.message, 300) for w in found]
                log.warning("config_warnings", config=name, count=len(found), warnings=shown)
        return self._merged

    async def remember(self, name: str | None) -> None:
        """Keep the config last applied on disk, so a restart without the API server serves it."""
        texts = [*self._texts(), {}]
        try:
            await asyncio.to_thread(self.memory.save, Remembered(name, texts[0], texts[1]))
        except OSError as err:
            log.warning("last_good_not_saved", path=str(self.memory.path), error=err.strerror)

    async def remembered(self) -> tuple[str | None, SharingConfig | None]:
        """The name of the config last applied, and that config when it can still be parsed."""
        try:
            memory = await asyncio.to_thread(self.memory.load)
        except LastGoodError as err:
            log.warning("last_good_unreadable", error=bounded(str(err)))
            return None, None
        if memory is None or memory.config is None:
            return None, None
        configs = await asyncio.to_thread(self._parse, [dict(memory.configs), dict(memory.presets)], None)
        return memory.config, configs.get(memory.config)

    def _texts(self) -> list[dict[str, str]]:
        return [dict(w.current.data or {}) if w.current else {} for w in self.watches]

    def _parse(self, texts: list[dict[str, str]], gpus: tuple[Gpu, ...] | None) -> ConfigSet:
        sets = [self._parse_one(t, gpus) for t in texts]
        return merge(sets[0], sets[1]) if len(sets) > 1 else sets[0]

    def _parse_one(self, text: dict[str, str], gpus: tuple[Gpu, ...] | None) -> ConfigSet:
        return parse_configmap(text, gpus=gpus, catalog=self._catalog, default_mig_strategy=self._strategy)
