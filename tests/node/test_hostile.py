"""A hostile key in the user's ConfigMap on the real node: the agent refuses it before building it,
says so in an Event naming the key, and keeps serving its own config without a restart.

Tried as a user would before the fix: one extra key holding `version: v1` and 480,000 list items
(940 KB) took the agent to its 256 Mi limit within 4 s; it was OOM-killed and crash-looped. The
key and the edit to the selected config are undone afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab.helm import NAMESPACE, RELEASE

from tests.node.conftest import ALL_KINDS, CONFIG, EXPECTED, NodeUnderTest, container_status
from tests.polling import poll

pytestmark = pytest.mark.node

HOSTILE = "hostile"
# 480,000 items, 960,020 bytes: under the API server's 1 MiB for a ConfigMap, far over one config's.
HOSTILE_CONFIG = "version: v1\ngpus: [" + ",".join("0" * 480_000) + "]\n"
# The selected config edited: GPU 3 in 2 replicas instead of 4.
EDITED = ALL_KINDS.replace("replicas: 4", "replicas: 2")


@pytest.fixture
def restored(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """Afterwards: the hostile key gone, the selected config as it was, every slice allocatable."""
    try:
        yield node
    finally:
        node.delete_pods()
        node.patch_configs({HOSTILE: None, CONFIG: ALL_KINDS})
        node.wait_allocatable()


def _agent(node: NodeUnderTest) -> tuple[str, int]:
    """The agent's pod UID and its container's restart count."""
    (pod,) = node.agent_pods()
    return pod["metadata"]["uid"], container_status(pod, "agent")["restartCount"]


def test_a_hostile_configmap_key_is_refused_by_an_event_and_the_agent_keeps_serving(
    restored: NodeUnderTest,
) -> None:
    node = restored
    before = _agent(node)
    said = len(node.events("ConfigInvalid"))
    node.patch_configs({HOSTILE: HOSTILE_CONFIG})
    refused = poll(
        "the ConfigInvalid Event", lambda: node.events("ConfigInvalid"), lambda m: len(m) > said, 60
    )
    (message,) = refused[said:]
    assert message.startswith(f"ConfigMap keys with errors, not selected by this node: {HOSTILE}: ")
    assert "the limit for one config is 262144" in message
    # One more change, read with the hostile key still there: the agent has processed the key and
    # goes on with the configs beside it.
    node.patch_configs({CONFIG: EDITED})
    node.wait_allocatable({**EXPECTED, "nvidia.com/gpu.shared": "2"})
    name = node.start_pod("nvidia.com/gpu.shared")
    node.wait_running(name)
    assert before == _agent(node)  # the same pod, never restarted
    print(f"agent memory after the hostile key: {_memory(node)}")


def _memory(node: NodeUnderTest) -> dict[str, Any]:
    """The agent's peak memory: its process's VmHWM, and its container's cgroup (v1) peak."""
    status = node.kubectl("-n", NAMESPACE, "exec", f"ds/{RELEASE}", "--", "cat", "/proc/1/status")
    fields = (line.partition(":") for line in status.splitlines())
    seen: dict[str, Any] = {k: v.strip() for k, _, v in fields if k in ("VmHWM", "VmRSS")}
    (pod,) = node.agent_pods()
    container = container_status(pod, "agent")["containerID"].partition("://")[2]
    memory = Path("/sys/fs/cgroup/memory") / node.node.cgroup.name
    for path in memory.rglob(f"{container}/memory.max_usage_in_bytes"):
        seen["cgroup_max_usage_MiB"] = round(int(path.read_text()) / 2**20, 1)
    return seen
