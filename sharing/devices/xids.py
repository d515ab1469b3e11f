"""What an XID means, in a few words, for Events and logs people read (pure).

From NVIDIA's Xid catalog (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html)
and the dynamic page retirement guide (https://docs.nvidia.com/deploy/dynamic-page-retirement/):
the XIDs a data-centre GPU reports most often. Anything else is named by number only.
"""

from __future__ import annotations

APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs caused by applications (bad kernel, page fault in user code), not by the GPU: they say nothing
about its health, and change none (the default of `--ignored-xids`). NVIDIA's device plugin skips the
same list (`applicationErrorXids`, internal/rm/health.go in NVIDIA/k8s-device-plugin)."""

MEANINGS: dict[int, str] = {
    8: "GPU stopped processing (channel idle timeout)",
    13: "graphics engine exception (usually the application)",
    31: "GPU memory page fault (usually the application)",
    32: "invalid or corrupted push buffer stream",
    43: "GPU stopped processing (usually the application)",
    45: "preemptive cleanup after an earlier error",
    46: "GPU stopped processing",
    48: "double-bit ECC error (uncorrectable)",
    61: "internal micro-controller breakpoint or warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded; takes effect after a GPU reset",
    64: "ECC page retirement or row remapping failed",
    68: "video decoder exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (the affected application must restart)",
    95: "uncontained ECC error (the GPU needs a reset)",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


def describe(xid: int | None) -> str:
    """`XID 79 (GPU has fallen off the bus)`, or `XID 123` when its meaning is not listed here."""
    if xid is None:
        return "an error without an XID"
    meaning = MEANINGS.get(xid)
    return f"XID {xid} ({meaning})" if meaning else f"XID {xid}"
