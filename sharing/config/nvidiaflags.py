"""The parts of an NVIDIA device-plugin config the agent reads but does not act on: flags, resources, imex.

They are checked as NVIDIA's parser and flag validation check them (a config NVIDIA refuses is refused
here too), then ignored with a warning where the agent's own settings cover them. `flags.migStrategy`
is the one flag that matters: it says how MIG devices are advertised.
"""

from __future__ import annotations

from collections.abc import Sequence

from sharing.config.document import describe
from sharing.config.nvidiadevices import resource_name
from sharing.config.problems import Report, item, key
from sharing.config.schema import boolean, choice, fields

_BOOL_FLAGS = ("failOnInitError", "restartOnDeviceUnhealthy", "gdrcopyEnabled", "gdsEnabled", "mofedEnabled",
               "useNodeFeatureAPI")  # fmt: skip
_STRING_FLAGS = ("mpsRoot", "nvidiaDriverRoot", "nvidiaDevRoot", "deviceDiscoveryStrategy")
_PLUGIN: dict[str, tuple[str, ...] | None] = {
    "passDeviceSpecs": None, "deviceListStrategy": ("envvar", "volume-mounts", "cdi-annotations", "cdi-cri"),
    "deviceIDStrategy": ("uuid", "index"), "cdiAnnotationPrefix": (), "nvidiaCTKPath": (),
    "containerDriverRoot": (), "sharedDevicesAllocationPolicy": ("distributed", "packed"),
}  # fmt: skip
_GFD: dict[str, tuple[str, ...] | None] = {
    "oneshot": None,
    "noTimestamp": None,
    "sleepInterval": (),
    "outputFile": (),
    "machineTypeFile": (),
}
IGNORED = "ignored: the agent's own settings cover it"


def read_flags(report: Report, value: object, strategies: Sequence[str]) -> str | None:
    """`flags`: the MIG strategy it names (None when none); the other flags are checked, then ignored."""
    flags = fields(
        report, "flags", value, optional=("migStrategy", *_BOOL_FLAGS, *_STRING_FLAGS, "plugin", "gfd")
    )
    if flags is None:
        return None
    for flag in _BOOL_FLAGS:
        if flag in flags and boolean(report, key("flags", flag), flags[flag]) is not None:
            report.warn(key("flags", flag), IGNORED)
    for flag in _STRING_FLAGS:
        if flag in flags and _string(report, key("flags", flag), flags[flag]):
            report.warn(key("flags", flag), IGNORED)
    for group, known in (("plugin", _PLUGIN), ("gfd", _GFD)):
        if group in flags and _group(report, key("flags", group), flags[group], known):
            report.warn(key("flags", group), IGNORED)
    if "migStrategy" not in flags:
        return None
    return choice(report, "flags.migStrategy", flags["migStrategy"], strategies)


def _string(report: Report, path: str, value: object) -> bool:
    if not isinstance(value, str):
        report.error(path, f"expected a string, got {describe(value)}")
        return False
    return True


def _group(report: Report, path: str, value: object, known: dict[str, tuple[str, ...] | None]) -> bool:
    """A nested flag group: booleans (None), free strings (()) or one of some words."""
    group = fields(report, path, value, optional=tuple(known))
    if group is None:
        return False
    ok = True
    for name, words in known.items():
        if name not in group:
            continue
        where = key(path, name)
        given = group[name]
        if words is None:
            ok = boolean(report, where, given) is not None and ok
        elif name == "deviceListStrategy" and isinstance(given, list):
            ok = all(choice(report, item(where, i), v, words) is not None for i, v in enumerate(given)) and ok
        elif words:
            ok = choice(report, where, given, words) is not None and ok
        else:
            ok = _string(report, where, given) and ok
    return ok


def read_resources(report: Report, value: object) -> None:
    """`resources` ({gpus, mig}: [{pattern, name}]): checked as NVIDIA checks it, then ignored as it does."""
    resources = fields(report, "resources", value, optional=("gpus", "mig"))
    if resources is None:
        return
    for group, entries in resources.items():
        if not isinstance(entries, list):
            report.error(
                key("resources", group), f"expected a list of {{pattern, name}}, got {describe(entries)}"
            )
            continue
        for i, entry in enumerate(entries):
            path = item(key("resources", group), i)
            found = fields(report, path, entry, required=("pattern", "name"))
            if found and "pattern" in found:
                _string(report, key(path, "pattern"), found["pattern"])
            if found and "name" in found:
                resource_name(report, key(path, "name"), found["name"])
    report.warn("resources", "ignored, as NVIDIA's plugin ignores it: the agent names resources itself")


def read_imex(report: Report, value: object) -> None:
    """`imex` ({channelIDs: [] or [0], required}): checked as NVIDIA checks it, then ignored."""
    imex = fields(report, "imex", value, optional=("channelIDs", "required"))
    if imex is None:
        return
    ok = True
    if "required" in imex:
        ok = boolean(report, "imex.required", imex["required"]) is not None
    ids = imex.get("channelIDs", [])
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        report.error("imex.channelIDs", f"expected a list of integers, got {describe(ids)}")
        ok = False
    elif ids not in ([], [0]):
        report.error("imex.channelIDs", f"channelIDs must be [] or [0]; found {ids}")
        ok = False
    if ok:
        report.warn("imex", "ignored: the agent does not inject IMEX channels")
