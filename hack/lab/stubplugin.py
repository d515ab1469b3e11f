"""The Go stub device plugin (``hack/go/k8s/stubplugin``): a minimal peer that speaks the kubelet's
device-plugin API, for testing the kubelet harness and the real node without our own plugins
(e.g. that containerd applies the CDI names a plugin returns).
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterable
from pathlib import Path

from lab.binaries import binaries
from lab.process import Process


class StubDevicePlugin:
    """The Go stub device plugin (``hack/go/k8s/stubplugin``) as a context manager.

    Registers ``resource`` with the kubelet (harness) whose ``kubelet.sock`` is in ``plugin_dir``,
    re-registers when kubelet.sock is re-created, and advertises ``devices`` (``"ID"`` or
    ``"ID Unhealthy"``). ``set_devices`` changes them (sent on ListAndWatch). Allocate returns env
    ``STUB_VISIBLE_DEVICES``; with ``preferred`` it offers GetPreferredAllocation and prefers the
    highest IDs. ``quiet`` leaves out the log line per call (a benchmark peer); ``poke`` makes it
    read its devices at once rather than at its next poll (~100 ms).
    """

    def __init__(
        self,
        plugin_dir: str | os.PathLike[str],
        resource: str = "example.com/dev",
        devices: Iterable[str] = ("Dev-1", "Dev-2"),
        *,
        preferred: bool = False,
        prestart: bool = False,
        quiet: bool = False,
        binary: str | os.PathLike[str] | None = None,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.resource = resource
        self._devices = list(devices)
        self._preferred = preferred
        self._prestart = prestart
        self._quiet = quiet
        self._binary = Path(binary) if binary is not None else None
        self._dir: Path | None = None
        self._proc: Process | None = None
        self.log = Path()

    @property
    def devices_file(self) -> Path:
        assert self._dir is not None
        return self._dir / "devices"

    def set_devices(self, devices: Iterable[str]) -> None:
        """Replace the device list; the plugin notices within ~100 ms and sends it on ListAndWatch."""
        self._devices = list(devices)
        tmp = self.devices_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{d}\n" for d in self._devices) or "# none\n")
        tmp.replace(self.devices_file)

    def poke(self) -> None:
        """Read the devices file now (SIGUSR1), so a change is sent without waiting for the poll."""
        if self._proc is not None and self._proc.running():
            os.kill(self._proc.pid, signal.SIGUSR1)

    def start(self) -> StubDevicePlugin:
        binary = self._binary or binaries().stub_device_plugin
        self._dir = Path(tempfile.mkdtemp(prefix="sharing-stubplugin-"))
        self.set_devices(self._devices)
        self.log = self._dir / "stub-device-plugin.log"
        args = [
            str(binary),
            f"--plugin-dir={self.plugin_dir}",
            f"--resource={self.resource}",
            "--devices=",
            f"--devices-file={self.devices_file}",
            f"--preferred={str(self._preferred).lower()}",
            f"--prestart={str(self._prestart).lower()}",
        ]
        if self._quiet:
            args.append("--quiet")
        self._proc = Process("stub-device-plugin", args, self.log)
        self._proc.start()
        return self

    def stop(self) -> None:
        """Stop the plugin (its ListAndWatch stream ends, so the kubelet marks the devices unhealthy)."""
        if self._proc is not None:
            self._proc.stop()
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> StubDevicePlugin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
