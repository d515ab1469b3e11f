"""What the agent tells operators and probes (orchestration): `/healthz`, `/readyz`, `/status`, `/metrics`.

`status` builds the status document (pure; `sharing status` prints the same), `metrics` the Prometheus
registry computed from it, `http` the small HTTP server, and `report` answers its routes.
"""

from sharing.ops.http import Answer, Handler, HttpServer
from sharing.ops.metrics import Metrics
from sharing.ops.report import Reporter
from sharing.ops.status import ConfigStatus, status_document

__all__ = ["Answer", "ConfigStatus", "Handler", "HttpServer", "Metrics", "Reporter", "status_document"]
