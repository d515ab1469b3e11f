"""The value forms of NVIDIA device-plugin configs, read exactly as NVIDIA's parser reads them.

`devices` (api/config/v1/replicas.go): the string `all`, a count > 0, or a list whose items are
GPU indices (a number, or a string of digits), MIG indices (`"0:1"`), GPU UUIDs (`GPU-<uuid>`) or
MIG UUIDs (`MIG-<uuid>`, `MIG-GPU-<uuid>/<gi>/<ci>`); a UUID is what google/uuid parses (36 chars
with dashes, 32 hex digits, `{...}` or `urn:uuid:...`). Resource names (resources.go): `nvidia.com/`
is prepended unless the name starts with it, the whole name has at most 63 characters and the
part after the prefix is a DNS-1123 subdomain.
"""

from __future__ import annotations

import re
from typing import Final, Literal

from sharing.config.document import describe, short_int
from sharing.config.problems import Report, item

ALL: Final = "all"
MAX_COUNT = 256
PREFIX = "nvidia.com/"
_HEX = re.compile(r"^[0-9a-fA-F]+$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MIG_RESOURCE = re.compile(
    r"^nvidia\.com/mig-(?P<profile>(?:\d+c\.)?\d+g\.\d+gb)(?P<attrs>(?:\.[a-z]+)*)(?P<no>-me)?$"
)

Devices = tuple[int | str, ...] | Literal["all"]


def is_uuid(text: str) -> bool:
    """True for what github.com/google/uuid's Parse accepts."""
    if len(text) == 36 + 9 and text[:9].lower() == "urn:uuid:":
        text = text[9:]
    elif len(text) == 38 and text[0] == "{" and text[-1] == "}":
        text = text[1:-1]
    if len(text) == 32:
        return bool(_HEX.match(text))
    if len(text) != 36 or any(text[i] != "-" for i in (8, 13, 18, 23)):
        return False
    return bool(_HEX.match(text.replace("-", "")))


def _is_mig_uuid(text: str) -> bool:
    suffix = text.removeprefix("MIG-")
    if is_uuid(suffix):
        return True
    parts = suffix.split("/", 2)
    return (
        len(parts) == 3
        and parts[0].startswith("GPU-")
        and is_uuid(parts[0][4:])
        and all(p.isascii() and p.isdigit() for p in parts[1:])
    )


def read(report: Report, path: str, value: object) -> Devices | None:
    """`all`, or the GPUs selected (indices, GPU UUIDs); None after reporting an error.

    A list that names MIG devices (indices `i:j` or MIG UUIDs) is accepted and, like NVIDIA's
    plugin does with every `devices` list, applied to all devices.
    """
    if isinstance(value, str):
        if value != ALL:
            report.error(path, f"devices set as {value!r} but the only valid string is 'all'")
            return None
        return ALL
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 < value <= MAX_COUNT:
            report.error(
                path, f"a count of devices must be between 1 and {MAX_COUNT}, got {short_int(value)}"
            )
            return None
        return tuple(range(value))
    if not isinstance(value, list):
        report.error(path, f"expected all, a count or a list of devices, got {describe(value)}")
        return None
    selected: list[int | str] = []
    names_mig = False
    for i, entry in enumerate(value):
        where = item(path, i)
        if isinstance(entry, int) and not isinstance(entry, bool) and 0 <= entry < 2**32:
            selected.append(entry)
        elif isinstance(entry, str) and entry.isascii() and entry.isdigit():
            selected.append(int(entry))
        elif isinstance(entry, str) and entry.startswith("GPU-") and is_uuid(entry[4:]):
            selected.append(entry)
        elif isinstance(entry, str) and (
            _is_mig_index(entry) or (entry.startswith("MIG-") and _is_mig_uuid(entry))
        ):
            names_mig = True
        else:
            report.error(
                where,
                f"unsupported device {describe(entry)}: expected a GPU index, a MIG index like '0:1', "
                "or a GPU or MIG UUID",
            )
            return None
    duplicates = sorted({str(d) for d in selected if selected.count(d) > 1})
    if duplicates:
        report.warn(path, f"listed more than once: {', '.join(duplicates)}")
    if names_mig:
        report.warn(path, "names MIG devices: like NVIDIA's plugin, the entry applies to every device of the "
                    "resource (single MIG devices cannot be selected)")  # fmt: skip
        return ALL
    if not selected:
        report.warn(path, "an empty list selects no GPU: the entry does nothing (NVIDIA's plugin, which "
                    "ignores `devices`, would replicate every device)")  # fmt: skip
    return tuple(dict.fromkeys(selected))


def _is_mig_index(text: str) -> bool:
    parts = text.split(":", 1)
    return len(parts) == 2 and all(p.isascii() and p.isdigit() for p in parts)


def resource_name(report: Report, path: str, value: object) -> str | None:
    """A resource name as NVIDIA's NewResourceName builds it, or None after reporting why not."""
    if not isinstance(value, str):
        report.error(path, f"expected a resource name, got {describe(value)}")
        return None
    full = value if value.startswith(PREFIX) else PREFIX + value
    short = full.removeprefix(PREFIX)
    if len(full) > 63:
        report.error(path, f"{full!r}: a fully-qualified resource name has at most 63 characters")
        return None
    if "/" in short:
        report.error(
            path,
            f"{value!r}: NVIDIA's plugin serves only {PREFIX} resources (it reads this as {full!r}, "
            "which is not a valid name)",
        )
        return None
    labels = short.split(".")
    if (
        not short
        or len(short) > 253
        or not all(_DNS_LABEL.match(label) and len(label) <= 63 for label in labels)
    ):
        report.error(
            path,
            f"{full!r}: the name after {PREFIX} must be a DNS-1123 subdomain (lower-case letters, digits, "
            "'-' and '.'); NVIDIA's plugin adds nvidia.com/ to names without it",
        )
        return None
    return full


def mig_profile(resource: str) -> str | None:
    """The MIG profile of a mixed-strategy resource (`nvidia.com/mig-1g.10gb.me` -> `1g.10gb+me`)."""
    match = _MIG_RESOURCE.match(resource)
    if match is None:
        return None
    attrs = match["attrs"]
    return match["profile"] + ("+" + attrs[1:] if attrs else "") + (match["no"] or "")
