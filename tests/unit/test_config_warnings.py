"""Every warning of the ConfigMaps reaches people: all of them in the agent's log (one line per config),
those of the node's config in `sharing status` and in one bounded Event, a count per config in the
metrics."""

from __future__ import annotations

from pathlib import Path

import structlog

from sharing.cli.status import describe
from sharing.config import ConfigSet, MigStrategy, Problem
from sharing.devices import Inventory
from sharing.kube import ConfigSources, NodePublisher, Watched
from sharing.mig import default_catalog
from sharing.model import Gpu, GpuUuid, NodeState
from sharing.ops import ConfigStatus, Metrics, status_document
from tests.unit.fakekube import FakeKube

CATALOG = default_catalog()
A100 = Gpu(0, GpuUuid("GPU-0"), "NVIDIA A100-SXM4-40GB", 40960, True, False, False, pci_device_id=0x20B010DE)
OTHERS = ("H100-80GB-HBM3", "H200", "L4", "T4", "A30", "A100-SXM4-80GB", "L40S", "B200", "H100-PCIE", "A10")
MINE = "version: v1\ngpus:\n" + "".join(f"  - devices: {{product: {p}}}\n    replicas: 2\n" for p in OTHERS)
"""Ten rules for GPUs this node lacks: ten warnings, the rule does nothing here."""
SAID = "matches none of the node's GPUs (A100-SXM4-40GB): the rule does nothing here"


async def test_the_log_has_every_warning_one_line_per_config(tmp_path: Path) -> None:
    kube = FakeKube("n1", {("gpu-sharing", "mine"): {"mine": MINE, "quiet": "version: v1\n"},
                           ("gpu-sharing", "presets"): {"preset": MINE}})  # fmt: skip
    sources = ConfigSources(kube, CATALOG, namespace="gpu-sharing", names=("mine", "presets"),
                            watch_timeout_seconds=1, last_good=tmp_path / "last-good.json",
                            default_mig_strategy=MigStrategy.MIXED)  # fmt: skip
    for watched, name in zip(sources.watches, ("mine", "presets"), strict=True):
        watched.current = kube.get_configmap("gpu-sharing", name)
    with structlog.testing.capture_logs() as logs:
        configs = await sources.configs(NodeState((A100,)))
    said = [(e["config"], e["count"], e["warnings"]) for e in logs if e["event"] == "config_warnings"]
    every = [f"gpus[{i}].devices: {SAID}" for i in range(10)]
    assert [("mine", 10, every), ("preset", 10, every)] == said
    assert 10 == len(configs.warnings_for("mine"))


def problems(n: int) -> tuple[Problem, ...]:
    return tuple(Problem("mine", f"gpus[{i}].devices", SAID) for i in range(n))


async def test_the_nodes_config_gets_one_bounded_event_said_once_per_change() -> None:
    kube = FakeKube("n1", {})
    node = Watched("node", lambda: kube.get_node("n1"), lambda rv: kube.watch_node("n1", rv, 1), lambda n: n)
    node.current = kube.node
    publisher = NodePublisher(kube, node, CATALOG)
    await publisher.config_warnings("mine", problems(30))
    await publisher.config_warnings("mine", problems(30))  # no news
    ((kind, reason, message),) = kube.events
    assert ("Warning", "ConfigWarnings") == (kind, reason)
    assert len(message) <= 1000
    assert message.startswith(f"config 'mine' has 30 warnings: gpus[0].devices: {SAID}; gpus[1].devices: ")
    shown = message.count(SAID)
    assert message.endswith(f"; and {30 - shown} more (every one in `sharing status` and the agent's log)")
    await publisher.config_warnings("mine", problems(2))
    assert kube.events[-1][2] == (
        f"config 'mine' has 2 warnings: gpus[0].devices: {SAID}; gpus[1].devices: {SAID} "
        "(every one in `sharing status` and the agent's log)"
    )
    await publisher.config_warnings("mine", ())
    assert 2 == len(kube.events)  # none left: nothing to say


def test_status_lists_every_warning_of_the_nodes_config_and_counts_the_others_and_so_do_the_metrics() -> None:
    configs = ConfigSet(warnings=(*problems(12), Problem("preset", "gpus[0].devices", SAID)))
    status = ConfigStatus("mine", warnings=configs.warnings_for("mine"), warned={"mine": 12, "preset": 82})
    document = status_document("n1", NodeState((A100,)), Inventory(), (), status)
    config = document["config"]
    assert [p.as_dict() for p in problems(12)] == config["warnings"]
    assert {"mine": 12, "preset": 82} == config["warningsPerConfig"]
    text = describe(document).splitlines()
    assert [f"  gpus[{i}].devices: {SAID}" for i in range(12)] == [t for t in text if SAID in t]
    assert "warnings of the other configs (in the agent's log, `config_warnings`): preset 82" in text
    metrics = Metrics("test")
    metrics.snapshot(document, ())
    lines = metrics.render().decode().splitlines()
    assert 'gpu_sharing_config_warnings{config="mine"} 12.0' in lines
    assert 'gpu_sharing_config_warnings{config="preset"} 82.0' in lines
