"""The errors of the lab: one family, so callers catch one base and show its message."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """A component failed to build, start or answer."""


class BinariesUnavailable(ClusterError):
    """The Go binaries cannot be built here (no Go toolchain, nothing cached) and no overrides are set."""


class AdmissionError(ClusterError):
    """The kubelet harness rejected a pod (HTTP 409); ``error`` is the kubelet's message."""

    def __init__(self, error: str, reason: str, stage: str) -> None:
        super().__init__(f"{reason}: {error}")
        self.error = error
        self.reason = reason
        self.stage = stage
