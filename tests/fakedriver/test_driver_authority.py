"""The driver is the authority: GPUs are partitioned, advertised and labelled from what NVML reports.

Run through the real NVML backend and pynvml over the fake driver, which reports the profile table
written into its state: a product the shipped catalog does not contain, and the RTX PRO 6000's
12-slot placement grid, are planned, created, advertised and labelled from the driver's numbers.
"""

from __future__ import annotations

import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sharing.config import parse_file
from sharing.devices.inventory import build_inventory
from sharing.gpu import nvmlapi, simstate
from sharing.gpu.nvml import NvmlBackend
from sharing.gpu.simspec import spec_of
from sharing.labels import node_labels
from sharing.mig.catalog import Engines, Product, Profile, default_catalog
from sharing.rollout.apply import apply_config
from sharing.store.journal import Journal

CATALOG = default_catalog()

# A GPU no catalog knows: 6 slots, 3 compute slices, names that derive from its own memory sizes.
Z100 = Product(
    name="Z100",
    nvml_names=("NVIDIA Z100",),
    pci_device_ids=(0x2FF0,),
    memory_mib=61440,
    slots=6,
    compute_slices=3,
    profiles=(
        Profile("1g.15gb", 0, 30, 1, 2, 3, 15000, (0, 2, 4), 40, Engines(1, 1, 0, 1, 0)),
        Profile("3g.60gb", 2, 31, 3, 6, 1, 60416, (0,), 120, Engines(3, 3, 1, 3, 1)),
    ),
    compute_capability=(11, 0),
)


@pytest.fixture
async def z100(tmp_path: Path, state: Path, nvml: Any) -> AsyncIterator[tuple[NvmlBackend, Path]]:
    simstate.init_state(state, [spec_of(Z100), simstate.resolve_product(CATALOG, "T4")])
    backend = NvmlBackend(nvml, CATALOG)
    yield backend, tmp_path
    await backend.close()


async def test_a_gpu_the_catalog_lacks_is_partitioned_advertised_and_labelled(
    z100: tuple[NvmlBackend, Path],
) -> None:
    backend, tmp = z100
    assert CATALOG.find("NVIDIA Z100") is None
    before = await backend.observe()
    text = (
        "version: v1\nmigStrategy: mixed\ngpus:\n"
        "- {devices: [0], mig: {1g.15gb: 3}}\n- {devices: [1], replicas: 2}\n"
    )
    parsed = parse_file("z", text, gpus=before.gpus)
    assert [] == [str(p) for p in parsed.errors]
    (config,) = parsed.configs
    report = await apply_config(backend, config, catalog=CATALOG, journal=Journal(tmp / "journal"))
    assert report.ok, [g.reason for g in report.gpus]
    after = report.after
    assert after is not None
    assert [(gi.profile, gi.start, gi.size) for gi in after.gpus[0].instances] == [
        ("1g.15gb", 0, 2),
        ("1g.15gb", 2, 2),
        ("1g.15gb", 4, 2),
    ]
    inventory = build_inventory(after, config, catalog=CATALOG)
    assert [(n, len(d)) for n, d in inventory.resources] == [
        ("nvidia.com/gpu", 2),
        ("nvidia.com/mig-1g.15gb", 3),
    ]
    labels = node_labels(after, config, inventory, None, CATALOG)
    assert {
        "nvidia.com/mig-1g.15gb.product": "NVIDIA-Z100-MIG-1g.15gb",
        "nvidia.com/mig-1g.15gb.count": "3",
        "nvidia.com/mig-1g.15gb.memory": "15000",
        "nvidia.com/mig-1g.15gb.multiprocessors": "40",
        "nvidia.com/mig-1g.15gb.engines.decoder": "1",
        "nvidia.com/gpu.product": "Tesla-T4-SHARED",
        "nvidia.com/gpu.family": "turing",
    }.items() <= labels.items()


async def test_a_layout_the_driver_cannot_hold_is_refused_from_the_drivers_numbers(
    z100: tuple[NvmlBackend, Path],
) -> None:
    backend, _ = z100
    node = await backend.observe()
    parsed = parse_file(
        "z", "version: v1\ngpus:\n- {devices: [0], mig: {3g.60gb: 1, 1g.15gb: 1}}\n", gpus=node.gpus
    )
    assert [(p.path, p.message) for p in parsed.errors] == [
        (
            "gpus[0].mig",
            "the wanted instances need 8 placement slots and 4 compute slices; NVIDIA Z100 has 6 and 3",
        )
    ]


async def test_the_rtx_pro_6000_grid_runs_on_the_fake_driver(tmp_path: Path, state: Path, nvml: Any) -> None:
    simstate.init_state(state, [simstate.resolve_product(CATALOG, "0x2BB5")])
    backend = NvmlBackend(nvml, CATALOG)
    try:
        gpu = (await backend.observe()).gpus[0]
        assert gpu.profiles is not None
        assert (gpu.profiles.slots, gpu.profiles.require_profile("2g.48gb").placements) == (12, (0, 6))
        config = parse_file(
            "r", "version: v1\ngpus:\n- {devices: all, mig: {2g.48gb: 1, 1g.24gb-me: 2}}\n"
        ).configs[0]
        report = await apply_config(backend, config, catalog=CATALOG, journal=Journal(tmp_path / "journal"))
        assert report.ok, [g.reason for g in report.gpus]
        assert report.after is not None
        assert [(gi.profile, gi.start, gi.size) for gi in report.after.gpus[0].instances] == [
            ("2g.48gb", 0, 6),
            ("1g.24gb-me", 6, 3),
            ("1g.24gb-me", 9, 3),
        ]
        assert {} == backend.catalog_differences
    finally:
        await backend.close()


def _members(protocol: type) -> list[str]:
    hints = typing.get_type_hints(protocol)
    functions = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    properties = [n for n, v in vars(protocol).items() if isinstance(v, property)]
    return sorted({*hints, *functions, *properties} - {"_is_protocol"})


def test_the_real_pynvml_has_every_name_the_backend_uses() -> None:
    import pynvml  # noqa: PLC0415

    missing = [name for name in _members(nvmlapi.Nvml) if not hasattr(pynvml, name)]
    assert [] == missing


async def test_the_mps_client_limit_comes_from_the_compute_capability_nvml_reports(
    state: Path, nvml: Any
) -> None:
    """A V100 (7.0) serves 16 MPS clients, a T4 (7.5) 48 (NVIDIA's mps-control-daemon device.go)."""
    simstate.init_state(state, [simstate.resolve_product(CATALOG, p) for p in ("V100-SXM2-16GB", "T4")])
    backend = NvmlBackend(nvml, CATALOG)
    try:
        node = await backend.observe()
    finally:
        await backend.close()
    assert [(7, 0), (7, 5)] == [g.compute_capability for g in node.gpus]
    text = (
        "version: v1\ngpus:\n- {devices: [0], mps: {replicas: %d}}\n- {devices: [1], mps: {replicas: 48}}\n"
    )
    assert [] == [str(p) for p in parse_file("mps", text % 16, gpus=node.gpus).errors]
    assert [
        "gpus[0].mps.replicas: maximum allowed replicas exceeded: 17 > 16: GPU 0 (V100-SXM2-16GB), compute "
        "capability 7.0, serves at most 16 MPS clients (48 from 7.5, 16 before)"
    ] == [f"{p.path}: {p.message}" for p in parse_file("mps", text % 17, gpus=node.gpus).errors]
