"""Sharing configs: a ConfigMap's data (name -> YAML text) into named, validated SharingConfig values.

Pure: no I/O, no logging, no clock. Each key holds one document in the native format (DESIGN.md
"Config"), an NVIDIA device-plugin config or a mig-parted file (each of whose `mig-configs` entries
becomes its own config). Everything wrong is collected, not just the first thing, each problem with
its config name, YAML path and message; warnings come back as data. One bad key does not spoil the
others: `parse_configmap` answers per config, and `ConfigSet.require` raises when any is invalid.
Whatever the bytes, only the ConfigError family escapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sharing.config.check import DraftConfig, finish
from sharing.config.document import MAX_BYTES, MAX_CONFIG_BYTES, describe, load_document
from sharing.config.frontend import FRONTEND_LABEL, Frontend, FrontendChoice, choose_frontend, parse_frontend
from sharing.config.migparted import is_migparted, read_migparted
from sharing.config.native import read_native
from sharing.config.node import NodeGpu, node_from_gpus, node_from_names
from sharing.config.nvidia import is_nvidia, read_nvidia
from sharing.config.problems import CONFIGMAP, InvalidConfigError, Problem, Report, key
from sharing.config.spec import (
    GpuIdentity,
    MigMode,
    MigStrategy,
    MpsLimits,
    PciFilter,
    Replicas,
    Rule,
    Selector,
    Sharing,
    SharingConfig,
    identity,
    is_dynamic,
    target_for,
)
from sharing.mig import Catalog, default_catalog
from sharing.model import Gpu

__all__ = [
    "CONFIGMAP",
    "FRONTEND_LABEL",
    "MAX_BYTES",
    "ConfigSet",
    "Failed",
    "Frontend",
    "FrontendChoice",
    "GpuIdentity",
    "InvalidConfigError",
    "MigMode",
    "MigStrategy",
    "MpsLimits",
    "PciFilter",
    "Problem",
    "Replicas",
    "Rule",
    "Selected",
    "Selection",
    "Selector",
    "Sharing",
    "SharingConfig",
    "choose_frontend",
    "identity",
    "is_dynamic",
    "load_yaml",
    "node_from_names",
    "parse_config",
    "parse_configmap",
    "parse_file",
    "parse_frontend",
    "select_config",
    "target_for",
]

_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True, slots=True)
class ConfigSet:
    """Every config of a ConfigMap: the valid ones, and the errors and warnings of all of them."""

    configs: tuple[SharingConfig, ...] = ()
    errors: tuple[Problem, ...] = ()
    warnings: tuple[Problem, ...] = ()
    invalid: tuple[str, ...] = ()
    """Names of the configs (or keys) that have errors, in order."""

    @property
    def valid(self) -> bool:
        """True when nothing has an error."""
        return not self.errors

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the valid configs, in order."""
        return tuple(c.name for c in self.configs)

    def get(self, name: str) -> SharingConfig | None:
        """The valid config called `name`, or None."""
        return next((c for c in self.configs if c.name == name), None)

    def errors_for(self, name: str) -> tuple[Problem, ...]:
        """The errors of one config (and those of the ConfigMap as a whole)."""
        return tuple(p for p in self.errors if p.config in (name, CONFIGMAP))

    def warnings_for(self, name: str) -> tuple[Problem, ...]:
        """The warnings of one config (and those of the ConfigMap as a whole)."""
        return tuple(p for p in self.warnings if p.config in (name, CONFIGMAP))

    def require(self) -> tuple[SharingConfig, ...]:
        """All configs, or InvalidConfigError listing every error."""
        if self.errors:
            raise InvalidConfigError(self.errors)
        return self.configs


def parse_configmap(
    data: Mapping[Any, Any],
    *,
    products: Sequence[str] | None = None,
    gpus: Sequence[Gpu] | None = None,
    catalog: Catalog | None = None,
    default_mig_strategy: MigStrategy = MigStrategy.NONE,
) -> ConfigSet:
    """Parse and validate every key of a ConfigMap.

    The node's GPUs add placement checks and mig-parted matching: `gpus` as observed (each GPU's
    driver-reported profiles and exact PCI ids; what the agent passes), or `products` named by
    catalog name, NVML name or PCI id (offline). `default_mig_strategy` is the strategy of NVIDIA
    device-plugin configs that set no `flags.migStrategy` (NVIDIA's MIG_STRATEGY).
    """
    catalog = catalog or default_catalog()
    node: tuple[NodeGpu, ...] | None = None
    if gpus is not None:
        node = node_from_gpus(gpus, catalog)
    elif products is not None:
        node = node_from_names(products, catalog)
    size = sum(_size(k) + _size(v) for k, v in data.items())
    if size > MAX_BYTES:
        problem = Problem(
            CONFIGMAP,
            "",
            f"the data is {size} bytes; Kubernetes' limit for a ConfigMap is {MAX_BYTES} (1 MiB)",
        )
        return ConfigSet(errors=(problem,), invalid=(CONFIGMAP,))
    configs: list[SharingConfig] = []
    errors: list[Problem] = []
    warnings: list[Problem] = []
    invalid: list[str] = []
    origin: dict[str, str] = {}
    for name, value in data.items():
        report = Report(str(name))
        results = _parse_key(report, name, value, catalog, node, default_strategy=default_mig_strategy)
        for draft, entry_report, parsed in results:
            config = parsed
            if draft.name in origin:
                path = "" if draft.name == name else key("mig-configs", draft.name)
                entry_report.error(path, f"defined twice: by key {origin[draft.name]!r} and key {name!r}")
                config = None
            origin.setdefault(draft.name, str(name))
            if entry_report is not report:
                errors.extend(entry_report.errors)
                warnings.extend(entry_report.warnings)
            if config is not None and not entry_report.errors:
                configs.append(config)
            elif draft.name not in invalid:
                invalid.append(draft.name)
        errors.extend(report.errors)
        warnings.extend(report.warnings)
        if report.errors and str(name) not in invalid:
            invalid.append(str(name))
    return ConfigSet(tuple(configs), tuple(errors), tuple(warnings), tuple(invalid))


def parse_file(
    name: str,
    text: str | bytes,
    *,
    products: Sequence[str] | None = None,
    gpus: Sequence[Gpu] | None = None,
    catalog: Catalog | None = None,
    default_mig_strategy: MigStrategy = MigStrategy.NONE,
) -> ConfigSet:
    """Every config of one document, each on its own (a mig-parted file has several): one invalid
    config does not spoil the others, exactly as in a ConfigMap."""
    return parse_configmap(
        {name: text}, products=products, gpus=gpus, catalog=catalog, default_mig_strategy=default_mig_strategy
    )


def parse_config(
    name: str,
    text: str | bytes,
    *,
    products: Sequence[str] | None = None,
    gpus: Sequence[Gpu] | None = None,
    catalog: Catalog | None = None,
    default_mig_strategy: MigStrategy = MigStrategy.NONE,
) -> tuple[SharingConfig, ...]:
    """The configs of one document, all of them valid, or InvalidConfigError listing every error."""
    return parse_file(
        name, text, products=products, gpus=gpus, catalog=catalog, default_mig_strategy=default_mig_strategy
    ).require()


def load_yaml(raw: str | bytes, name: str = "document") -> Any:
    """One YAML document, read as safely as a config; InvalidConfigError when unreadable."""
    report = Report(name)
    ok, value = load_document(report, raw)
    if not ok or report.errors:
        raise InvalidConfigError(report.errors)
    return value


_Result = tuple[DraftConfig, Report, SharingConfig | None]


def _parse_key(
    report: Report,
    name: object,
    value: object,
    catalog: Catalog,
    node: tuple[NodeGpu, ...] | None,
    *,
    default_strategy: MigStrategy,
) -> list[_Result]:
    if not isinstance(name, str) or not _KEY.match(name) or name in (".", ".."):
        report.error("", "not a valid ConfigMap key (letters, digits, '-', '_', '.'; at most 253 characters)")
        return []
    if not _LABEL_VALUE.match(name):
        report.warn(
            "",
            "no node label can name this config (a label value has at most 63 characters, "
            "letters, digits, '-', '_', '.', and starts and ends with a letter or digit)",
        )
    if not isinstance(value, str | bytes):
        report.error("", f"expected the config as text, got {describe(value)}")
        return []
    ok, doc = load_document(report, value, MAX_CONFIG_BYTES)
    if not ok:
        return []
    if not isinstance(doc, dict):
        what = "the document is empty" if doc is None else f"got {describe(doc)}"
        report.error("", f"expected a mapping at the top of the document ({what})")
        return []
    if is_migparted(doc):
        results = []
        for draft, entry_report in read_migparted(report, doc):
            config = finish(entry_report, draft, catalog, node)
            if report.errors:
                entry_report.error("", f"the mig-parted file in key {name!r} it comes from is invalid")
                config = None
            results.append((draft, entry_report, config))
        return results
    if is_nvidia(doc):
        draft = read_nvidia(report, name, doc, default_strategy)
    else:
        draft = read_native(report, name, doc)
    return [(draft, report, finish(report, draft, catalog, node))]


def _size(value: object) -> int:
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, str):
        return len(value.encode("utf-8", "replace"))
    return 0


# Last: selection reads ConfigSet, defined above.
from sharing.config.selection import Failed, Selected, Selection, select_config  # noqa: E402
