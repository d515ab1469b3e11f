"""One error family per boundary, under one base, so callers can catch what they can act on.

Messages name the GPU, the resource or the YAML path, and say what to do.
"""


class SharingError(Exception):
    """Base of every error the agent raises on purpose."""


class CatalogError(SharingError):
    """An unknown product or profile, or a broken catalog."""


class ConfigError(SharingError):
    """A sharing config that cannot be parsed or is invalid."""


class BackendError(SharingError):
    """A GPU backend (NVML or simulated) refused or failed an operation."""


class KubeError(SharingError):
    """The Kubernetes API refused or failed a request."""


class PluginError(SharingError):
    """A device-plugin server or the kubelet refused or failed a request."""


class ExportError(SharingError):
    """A `sharing export --json` document that cannot be read back (wrong shape or values)."""
