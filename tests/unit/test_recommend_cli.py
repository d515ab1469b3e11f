"""`sharing recommend --from FILE` on a `sharing export --json` document: the same advice offline, a config
that the agent's own checks accept, and clear errors (never a traceback) for files that are not one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from sharing.cli import main
from sharing.config import parse_configmap
from sharing.mig import Product, default_catalog
from sharing.model import NodeState
from sharing.ops.exported import export_document, read_export
from tests.unit.test_recommend import a100, h100, mig_slice, status, whole_slices

A100 = default_catalog().product("A100-SXM4-40GB")


def node_and_status() -> tuple[NodeState, dict[str, Any]]:
    """GPU 0 all 1g with `a` on slot 0; GPU 1 two 3g.20gb with `b` (2 GiB) on slot 0; GPU 2 an H100
    time-sliced 4 ways with a notebook; GPU 1 with the driver's profiles, as the NVML backend reads them."""
    first = a100(0, [("1g.5gb", s) for s in range(7)])
    second = replace(a100(1, [("3g.20gb", 0), ("3g.20gb", 4)]), profiles=A100)
    third = h100(2)
    doc = status(
        [
            (
                first,
                [
                    mig_slice(first, s, "a" if s == 0 else None, "1g.5gb" if s == 0 else None)
                    for s in range(7)
                ],
            ),
            (second, [mig_slice(second, 0, "b", "1g.5gb"), mig_slice(second, 4)]),
            (third, whole_slices(third, 4, {1: "notebook"})),
        ]
    )
    return NodeState((first, second, third)), doc


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    node, doc = node_and_status()
    path = tmp_path / "export.json"
    path.write_text(json.dumps(export_document(node, doc)))
    return path


def test_an_export_reads_back_as_the_gpus_it_was_made_of() -> None:
    node, doc = node_and_status()
    back, status_back = read_export(json.loads(json.dumps(export_document(node, doc))))
    assert doc == status_back
    assert [replace(g, profiles=None) for g in node.gpus] == [replace(g, profiles=None) for g in back.gpus]
    # The driver's profiles, as far as placing instances goes.
    assert [None, geometry(A100), None] == [geometry(g.profiles) if g.profiles else None for g in back.gpus]


def geometry(product: Product) -> tuple[object, ...]:
    return (
        product.slots,
        product.compute_slices,
        tuple(
            (p.name, p.id, p.compute_slices, p.size, p.max_count, p.memory_mib, p.placements)
            for p in product.profiles
        ),
    )


def test_the_recommended_config_is_printed_under_what_it_frees_and_whom_it_waits_for(
    exported: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert 0 == main(["recommend", "--from", str(exported)])
    out = capsys.readouterr().out
    comments = [line for line in out.splitlines() if line.startswith("#")]
    assert "# GPU 0  NVIDIA A100-SXM4-40GB: held 1g.5gb, at its right size" in comments
    assert "#   free room 6 compute and 7 memory slices: 6x 1g.5gb as they are" in comments
    assert (
        "# GPU 1  NVIDIA A100-SXM4-40GB: held 3g.20gb -> 1g.5gb: frees 2 compute and 3 memory slices"
    ) in comments
    assert "#   free room 6 compute and 7 memory slices: 3g.20gb as it is; new 2g.10gb, 1g.5gb" in comments
    assert (
        "#   ml/b/main holds 3g.20gb MIG-1-0, right size 1g.5gb: the rollout waits for it to end (or drain "
        "mode evicts it)"
    ) in comments
    assert "# GPU 2  NVIDIA H100 80GB HBM3: MIG off, 4 time-sliced replicas: kept" in comments
    assert "#   ml/notebook/main: in MIG, 1g.10gb would hold it" in comments
    config = yaml.safe_load(out)
    assert {
        "version": "v1",
        "migStrategy": "mixed",
        "sharing": {"renameByDefault": True},
        "gpus": [
            {"devices": [0], "mig": {"1g.5gb": 7}},
            {"devices": [1], "mig": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}},
            {"devices": [2], "mig": "disabled", "replicas": 4},
        ],
    } == config
    node, _ = node_and_status()
    assert () == parse_configmap({"recommended": out}, gpus=node.gpus).errors


def test_json_carries_the_config_text_and_each_gpus_advice(
    exported: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert 0 == main(["recommend", "--from", str(exported), "--json", "--name", "smaller"])
    document = json.loads(capsys.readouterr().out)
    assert ("n1", "smaller") == (document["node"], document["name"])
    second = document["gpus"][1]
    assert ({"computeSlices": 2, "memorySlices": 3}, ["3g.20gb", "2g.10gb", "1g.5gb"], True) == (
        second["frees"], second["freeRoom"], second["waits"]
    )  # fmt: skip
    assert ["2g.10gb", "1g.5gb"] == second["made"]
    change = {"holder": "ml/b/main", "device": "MIG-1-0", "profile": "3g.20gb", "to": "1g.5gb", "waits": True}
    assert [change] == second["changes"]
    assert yaml.safe_load(document["config"])["gpus"][1]["mig"] == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}


@pytest.mark.parametrize(
    ("content", "code", "message"),
    [
        pytest.param(None, 2, "cannot read", id="missing"),
        pytest.param(b"\x00\xff junk", 2, "is not JSON", id="junk"),
        pytest.param(b'{"gpus": [], "status": null}', 2, "has no usage: it was exported where no agent",
                     id="no-agent"),
        pytest.param(b'{"gpus": [{"index": 0}], "status": {}}', 1, "gpus[0].product: expected a string",
                     id="wrong-shape"),
        pytest.param(b"[1, 2]", 1, "the document: expected an object", id="not-an-object"),
    ],
)  # fmt: skip
def test_a_file_that_is_not_an_export_with_usage_is_refused_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, code: int, message: str
) -> None:
    path = tmp_path / "export.json"
    if content is not None:
        path.write_bytes(content)
    assert code == main(["recommend", "--from", str(path)])
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_a_replica_of_a_whole_gpu_that_only_the_whole_gpu_holds_is_told_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu = h100(0)
    slices = whole_slices(gpu, 2, {0: "trainer"})
    slices[0]["usage"]["rightSize"]["profile"] = "7g.80gb"
    path = tmp_path / "export.json"
    path.write_text(json.dumps(export_document(NodeState((gpu,)), status([(gpu, slices)]))))
    assert 0 == main(["recommend", "--from", str(path)])
    out = capsys.readouterr().out
    assert (
        "#   ml/trainer/main: only 7g.80gb, the whole GPU in MIG, would hold it: no smaller profile does"
        in out
    )
