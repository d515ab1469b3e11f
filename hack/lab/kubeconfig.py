"""Kubeconfig files: one cluster, one user (client certificate or bearer token), one context."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write(
    path: Path,
    server: str,
    ca: Path,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    token: str | None = None,
    user: str = "admin",
) -> Path:
    """Write a kubeconfig (JSON, which is YAML) readable only by its owner; return ``path``."""
    entry: dict[str, Any] = {}
    if cert is not None and key is not None:
        entry = {"client-certificate": str(cert), "client-key": str(key)}
    if token is not None:
        entry = {"token": token}
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "sharing", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": entry}],
        "contexts": [{"name": "sharing", "context": {"cluster": "sharing", "user": user}}],
        "current-context": "sharing",
    }
    path.write_text(json.dumps(cfg, indent=2))
    path.chmod(0o600)
    return path
