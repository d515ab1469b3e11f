"""The node's choice of front-end on the real node: a label value that names none is refused.

The session node of tests/node/conftest.py serves through the device plugins; the test puts its
label back, so every other test finds the node as the session made it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.node.conftest import EXPECTED, NODE, NodeUnderTest
from tests.polling import poll

pytestmark = pytest.mark.node

FRONTEND = "nvidia.com/gpu-sharing.frontend"
STATE = "nvidia.com/mig.config.state"


def _labels(node: NodeUnderTest) -> dict[str, str]:
    return dict(node.get("node", NODE)["metadata"].get("labels", {}))


@pytest.fixture
def unlabelled(node: NodeUnderTest) -> Iterator[NodeUnderTest]:
    """The node; its front-end label removed afterwards, and its devices served again."""
    try:
        yield node
    finally:
        node.label(FRONTEND, None)
        poll("state success", lambda: _labels(node).get(STATE), lambda s: s == "success", 60)
        node.wait_allocatable()


def test_a_front_end_label_that_names_none_is_refused_and_the_node_keeps_serving(
    unlabelled: NodeUnderTest,
) -> None:
    node = unlabelled
    said = len(node.events("FrontendRejected"))
    node.label(FRONTEND, "nvlink")
    refused = poll(
        "the FrontendRejected Event", lambda: node.events("FrontendRejected"), lambda m: len(m) > said, 60
    )
    assert [
        f"node label {FRONTEND}=nvlink: 'nvlink' is not a front-end: deviceplugin or dra; the node stays on"
        " the deviceplugin front-end"
    ] == refused[said:]
    assert "failed" == _labels(node)[STATE]
    assert EXPECTED == node.offered()
    name = node.start_pod("nvidia.com/mig-1g.5gb")
    node.wait_running(name)
    log = node.agent_log()
    assert "Traceback" not in log
