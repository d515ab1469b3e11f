"""`sharing validate FILE`: check a ConfigMap, a config, an NVIDIA device-plugin config or a mig-parted file.

Exit 0 valid (one summary line per config), 1 invalid (one `CONFIG: PATH: MESSAGE` line per error),
2 bad arguments. Whatever the bytes in FILE, the answer is one of those, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from sharing.cli.common import Subparsers, UsageError, gpu_arg, print_json
from sharing.config import (
    MAX_BYTES,
    ConfigSet,
    InvalidConfigError,
    MigMode,
    Problem,
    Rule,
    Selector,
    Sharing,
    SharingConfig,
    load_yaml,
    node_from_names,
    parse_configmap,
)
from sharing.mig import default_catalog


def register(commands: Subparsers) -> None:
    """Add the command to the CLI."""
    parser = commands.add_parser(
        "validate",
        help="validate sharing configs (ConfigMap, config, device-plugin config or mig-parted file)",
        description="Validate sharing configs. FILE is a ConfigMap manifest, one native config (named after "
        "the file), an NVIDIA device-plugin config or a mig-parted file; '-' reads stdin. "
        "Exit 0 valid, 1 invalid, 2 bad arguments.",
    )
    parser.add_argument("file", metavar="FILE", help="the file to check, or - for stdin")
    parser.add_argument("--gpu", action="append", default=[], metavar="GPU",
                        help="a GPU of the node, by catalog name, NVML name or PCI id (0x2335; repeatable, "
                        "in index order: the first is GPU 0): check layouts on it and apply mig-parted "
                        "files as on that node")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Validate and print."""
    for name in args.gpu:
        gpu_arg(name)  # an unknown GPU is a usage error
    products = list(args.gpu) or None
    raw, name = _read(args.file)
    data, problems = configmap_data(raw, name)
    result = parse_configmap(data, products=products)
    errors = list(problems) + list(result.errors)
    if args.json:
        print_json(
            {
                "valid": not errors,
                "configs": [config_json(c, products) for c in result.configs],
                "errors": [p.as_dict() for p in errors],
                "warnings": [p.as_dict() for p in result.warnings],
            }
        )
    else:
        _print(result, errors, products)
    return 1 if errors else 0


def _read(file: str) -> tuple[bytes, str]:
    if file == "-":
        return sys.stdin.buffer.read(MAX_BYTES + 1), "stdin"
    path = Path(file)
    try:
        with path.open("rb") as stream:
            return stream.read(MAX_BYTES + 1), path.stem
    except OSError as err:
        raise UsageError(f"cannot read {file}: {err.strerror or err}") from err


def configmap_data(raw: bytes, name: str) -> tuple[dict[Any, Any], list[Problem]]:
    """A ConfigMap manifest's data, or the whole file as one key named `name`."""
    try:
        doc = load_yaml(raw, name)
    except InvalidConfigError:
        return {name: raw}, []  # parsing it as a config reports the same problem, with the config's name
    if not isinstance(doc, dict) or doc.get("kind") != "ConfigMap":
        return {name: raw}, []
    data = doc.get("data", {})
    if not isinstance(data, dict):
        return {}, [Problem(name, "data", "expected a mapping of config names to config text")]
    return data, []


def _print(result: ConfigSet, errors: list[Problem], products: list[str] | None) -> None:
    for config in result.configs:
        print(f"{config.name}: {summary(config, products)}")
    for problem in result.warnings:
        print(f"warning: {problem}", file=sys.stderr)
    for problem in errors:
        print(problem)
    invalid = len(result.invalid)
    print(f"{len(result.configs)} valid, {invalid} invalid", file=sys.stderr)


def summary(config: SharingConfig, products: list[str] | None = None) -> str:
    """One line: what the config does, per rule, or per given GPU (each named once: GPUs of one
    product that are treated alike are one part, with their indices when the product's GPUs differ)."""
    head = f"[{config.mig_strategy.value}]"
    if not products:
        parts = [f"{_selector(r.devices)}: {_action(r)}" for r in config.rules]
        return f"{head} " + ("; ".join(parts) if parts else "no rules: every GPU is left as it is")
    node = node_from_names(products, default_catalog())
    groups: dict[tuple[str, str], list[int]] = {}
    for index in range(len(products)):
        entries = [g for g in node if g.identity.index == index]  # one per PCI id the product may have
        rule = next((r for r in config.rules if any(r.devices.matches(g.identity) for g in entries)), None)
        mig = entries[0].geometry is not None
        skipped = rule is not None and rule.skip_without_mig and rule.mig is MigMode.ENABLED and not mig
        action = _action(rule) if rule and not skipped else "left as it is"
        if rule is not None and rule.mig is MigMode.DYNAMIC and not mig:
            action = "no MIG: a whole GPU"  # spec.is_dynamic
        groups.setdefault((entries[0].name, action), []).append(index)
    shared = [name for name, _ in groups]
    parts = []
    for (name, action), indices in groups.items():
        where = ""
        if shared.count(name) > 1:
            where = f" (GPU{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))})"
        parts.append(f"{name}{where}: {action}")
    return f"{head} " + "; ".join(parts)


def _selector(selector: Selector) -> str:
    indices = ",".join(map(str, selector.indices))
    if selector.all:
        return "all GPUs"
    if selector.pci:
        pci = ", ".join(str(f) for f in selector.pci)
        return f"PCI {pci} at {indices}" if indices else f"PCI {pci}"
    if selector.uuids:
        return ", ".join(selector.uuids)
    if selector.product is not None:
        return f"{selector.product} at {indices}" if indices else selector.product
    return f"GPUs {indices}"


def _action(rule: Rule) -> str:
    if rule.mig is MigMode.ENABLED and rule.instances:
        text = "MIG " + " + ".join(f"{n}x {p}" for p, n in rule.instances)
    else:
        text = {
            MigMode.DISABLED: "MIG off",
            MigMode.ENABLED: "MIG on, no instances",
            MigMode.UNCHANGED: "MIG as is",
            MigMode.DYNAMIC: "MIG on, instances made per claim (DRA)",
        }[rule.mig]
    if rule.sharing is Sharing.MPS:
        return text + _mps(rule)
    if rule.replicas.default > 1:
        text += f", {rule.replicas.default} replicas each"
    if rule.replicas.per_device_kind:
        text += ", replicas " + ", ".join(f"{k}={n}" for k, n in rule.replicas.per_device_kind)
    if rule.rename:
        text += ", renamed " + ", ".join(f"{a}->{b}" for a, b in rule.rename)
    return text


def _mps(rule: Rule) -> str:
    """`, MPS: 4 replicas each with 25% of the threads and 10240 MiB`; the defaults spelt out."""
    replicas = rule.replicas.for_kind("gpu")
    threads = rule.mps.active_thread_percentage
    memory = rule.mps.pinned_memory_mib
    limits = f"{threads if threads is not None else 100 // replicas}% of the threads and " + (
        f"{memory} MiB" if memory is not None else f"1/{replicas} of the memory"
    )
    renamed = ", renamed " + ", ".join(f"{a}->{b}" for a, b in rule.rename) if rule.rename else ""
    return f", MPS: {replicas} replicas each with {limits}{renamed}"


def config_json(config: SharingConfig, products: list[str] | None = None) -> dict[str, object]:
    """The JSON shape of one valid config."""
    return {
        "name": config.name,
        "migStrategy": config.mig_strategy.value,
        "renameByDefault": config.rename_by_default,
        "failRequestsGreaterThanOne": config.fail_requests_greater_than_one,
        "summary": summary(config, products),
        "rules": [
            {
                "devices": "all"
                if r.devices.all
                else {
                    "indices": list(r.devices.indices),
                    "product": r.devices.product,
                    "pci": [str(f) for f in r.devices.pci],
                    "uuids": list(r.devices.uuids),
                },
                "mig": r.mig.value,
                "instances": dict(r.instances),
                "replicas": {"default": r.replicas.default, **dict(r.replicas.per_device_kind)},
                "rename": dict(r.rename),
                "sharing": r.sharing.value,
                "mps": {
                    "activeThreadPercentage": r.mps.active_thread_percentage,
                    "pinnedMemoryMiB": r.mps.pinned_memory_mib,
                }
                if r.sharing is Sharing.MPS
                else None,
            }
            for r in config.rules
        ],
    }
