"""Registration with the kubelet's plugin watcher: a `Registration` service on a socket in the
kubelet's plugins_registry directory.

The kubelet finds the socket there, dials in, calls GetInfo (type `DRAPlugin`, our driver name, the
DRA socket as the endpoint, the services we serve), dials the endpoint, and tells the plugin the
outcome through NotifyRegistrationStatus (k8s.io/kubelet pkg/apis/pluginregistration/v1/api.proto;
the Go helper's side: k8s.io/dynamic-resource-allocation kubeletplugin/registrationserver.go). The
plugin does not call the kubelet: removing the socket unregisters it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import structlog

from sharing.dra.names import DRIVER, PLUGIN_TYPE, SUPPORTED_VERSIONS
from sharing.kubelet.api import pluginregistration_v1_pb2 as reg

log = structlog.get_logger(__name__)


class RegistrationService:
    """The Registration service (duck-typed to the generated servicer)."""

    def __init__(self, endpoint: Path, on_status: Callable[[bool, str], None]) -> None:
        self.endpoint = endpoint
        self.on_status = on_status

    async def GetInfo(self, request: reg.InfoRequest, context: grpc.aio.ServicerContext) -> reg.PluginInfo:
        """Who we are and where the DRA service is."""
        log.debug("dra_get_info")
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRIVER,
            endpoint=str(self.endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.aio.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        """The kubelet's verdict, logged and kept."""
        if request.plugin_registered:
            log.info("dra_plugin_registered", driver=DRIVER, endpoint=str(self.endpoint))
        else:
            log.error("dra_plugin_registration_failed", driver=DRIVER, error=request.error)
        self.on_status(request.plugin_registered, request.error)
        return reg.RegistrationStatusResponse()
