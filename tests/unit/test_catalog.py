"""The hardware catalog: lookup by the names and PCI ids people and NVML use, sourced and consistent data."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sharing.errors import CatalogError
from sharing.mig.catalog import (
    INFERRED,
    PlainProduct,
    Product,
    default_catalog,
    differences,
    load_catalog,
    mig_memory_gb,
    parse_pci_id,
    profile_name,
)

CATALOG = default_catalog()
PRODUCTS = CATALOG.products
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("a100 sxm4 40gb", "A100-SXM4-40GB"),
        ("NVIDIA A800-SXM4-80GB", "A100-SXM4-80GB"),
        ("NVIDIA A800 80GB PCIe", "A100-PCIE-80GB"),
        ("NVIDIA H800", "H100-80GB-HBM3"),
        ("NVIDIA H800 NVL", "H100-NVL"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB-HBM3"),
        ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200-NVL"),
        ("NVIDIA GH200 480GB", "GH200-96GB"),
        ("NVIDIA GH200 144G HBM3e", "GH200-144GB"),
        ("NVIDIA A30", "A30"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000"),
        ("0x2335", "H200"),
        ("0x233510DE", "H200"),
        ("0x2329", "H20"),
        ("0x20b6", "PG506"),
        ("0x233D", "H100-96GB"),
        ("0x2339", "H100-SXM5-94GB"),
        ("0x232C", "H20-141GB"),
        ("0x2909", "B200"),
        ("0x3182", "B300"),
        ("0x31C3", "GB300"),
        ("0x2BB1", "RTX-PRO-6000"),
    ],
)
def test_products_are_found_by_nvml_name_catalog_name_and_pci_id(name: str, expected: str) -> None:
    found = CATALOG.find(name)
    assert found is not None
    assert expected == found.name


@pytest.mark.parametrize(
    ("name", "pci", "expected"),
    [
        pytest.param("NVIDIA A800-SXM4-80GB", 0x20F310DE, "A100-SXM4-80GB", id="a800-by-id"),
        pytest.param("Some future name", 0x233510DE, "H200", id="id-wins-over-unknown-name"),
        pytest.param("NVIDIA H200", None, "H200", id="name-without-id"),
        pytest.param("NVIDIA H200", 0x233512AB, "H200", id="other-vendor-id-falls-back-to-name"),
        pytest.param("NVIDIA L4", 0x27B810DE, "L4", id="no-mig"),
        pytest.param("NVIDIA Z999", 0xFFFF10DE, None, id="unknown"),
    ],
)
def test_an_observed_gpu_is_matched_by_pci_id_then_name(
    name: str, pci: int | None, expected: str | None
) -> None:
    found = CATALOG.for_gpu(name, pci)
    assert expected == (found.name if found is not None else None)


def test_gpus_without_mig_are_known_but_are_not_mig_products() -> None:
    for name in ("L4", "Tesla T4", "NVIDIA A10", "L40S", "0x27B8"):
        assert isinstance(CATALOG.describe(name), PlainProduct), name
        assert CATALOG.find(name) is None, name


def test_unknown_product_names_the_known_ones() -> None:
    with pytest.raises(CatalogError, match=r"unknown GPU product 'Tesla T4' \(known: A100-SXM4-40GB"):
        CATALOG.product("Tesla T4")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0x2335", 0x2335),
        ("0x233510DE", 0x2335),
        ("0x233510de", 0x2335),
        ("0x23351002", None),
        ("2335", None),
    ],
)
def test_pci_ids_are_read_with_or_without_nvidias_vendor(text: str, expected: int | None) -> None:
    assert expected == parse_pci_id(text)


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_profile_names_derive_from_memory_as_nvidia_does(product: Product) -> None:
    """At run time names come from the driver's numbers; the catalog's data must give the same names."""
    for profile in product.profiles:
        derived = profile_name(profile.enum, profile.compute_slices, profile.memory_mib, product.memory_mib)
        assert (profile.name, product.name) == (derived, product.name)


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_geometry_is_consistent(product: Product) -> None:
    for profile in product.profiles:
        assert profile.placements, profile.name
        for start in profile.placements:
            assert 0 <= start, (profile.name, start)
            assert start + profile.size <= product.slots, (profile.name, start)
        assert profile.compute_slices <= product.compute_slices
        assert 1 <= profile.max_count <= len(profile.placements) * product.slots
    assert len({p.name for p in product.profiles}) == len(product.profiles)
    assert len({p.id for p in product.profiles}) == len(product.profiles)


def _sourced(text: str) -> bool:
    return text.startswith(INFERRED) or bool(re.search(r"https://\S+|issue 12 of this project", text))


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_every_fact_names_its_source(product: Product) -> None:
    assert _sourced(product.source), product.source
    assert _sourced(product.placements_source), product.placements_source
    for profile in product.profiles:
        assert _sourced(profile.source), (profile.name, profile.source)
    assert "@" not in product.source + "".join(p.source for p in product.profiles)  # every alias resolved


@pytest.mark.parametrize(
    ("product", "profile", "mib"),
    [
        # Posted `nvidia-smi mig -lgip` output, GiB x 1024 (the values issue 12 found wrong or missing).
        ("A30", "1g.6gb", 5952),
        ("A30", "2g.12gb", 11968),
        ("H100-NVL", "1g.24gb", 22144),
        ("H100-NVL", "2g.24gb", 22144),
        ("H100-NVL", "3g.47gb", 47488),
        ("H100-NVL", "4g.47gb", 47488),
        ("H100-NVL", "7g.94gb", 95360),
        ("H200", "1g.35gb", 33024),
        ("H200", "2g.35gb", 33024),
        ("H200", "3g.71gb", 71168),
        ("H200", "4g.71gb", 71168),
        ("H200", "7g.141gb", 143104),
        ("GH200-96GB", "1g.24gb", 23552),
        ("GH200-96GB", "2g.24gb", 23552),
        ("GH200-96GB", "3g.48gb", 47616),
        ("GH200-96GB", "4g.48gb", 47616),
        ("GH200-96GB", "7g.96gb", 95232),
        ("GH200-144GB", "1g.18gb", 17920),
        ("GH200-144GB", "1g.18gb+me", 17920),
        ("GH200-144GB", "1g.36gb", 36096),
        ("GH200-144GB", "2g.36gb", 36096),
        ("B200", "1g.45gb", 45312),
        ("B200", "2g.45gb", 45312),
        ("GB200", "1g.47gb", 46592),
        ("GB200", "2g.47gb", 46592),
        ("RTX-PRO-6000", "1g.24gb", 24192),
        ("RTX-PRO-6000", "2g.48gb", 48512),
        ("RTX-PRO-6000", "4g.96gb", 97408),
    ],
)
def test_memory_sizes_are_the_posted_ones(product: str, profile: str, mib: int) -> None:
    found = CATALOG.product(product).require_profile(profile)
    assert (mib, True) == (found.memory_mib, found.memory_verified)


def test_the_rtx_pro_6000_places_instances_on_a_grid_of_twelve() -> None:
    rtx = CATALOG.product("RTX-PRO-6000")
    assert 12 == rtx.slots
    placements = {p.name: (p.placements, p.size) for p in rtx.profiles}
    assert placements["1g.24gb"] == ((0, 3, 6, 9), 3)
    assert placements["1g.24gb-me"] == ((0, 3, 6, 9), 3)
    assert placements["2g.48gb+gfx"] == ((0, 6), 6)
    assert placements["4g.96gb"] == ((0,), 12)
    assert {"1g.24gb+me.all", "1g.24gb+gfx", "2g.48gb-me"} <= set(placements)


@pytest.mark.parametrize(
    ("product", "names"),
    [
        ("B300", ["1g.34gb", "1g.34gb+me", "1g.67gb", "2g.67gb", "3g.135gb", "4g.135gb", "7g.269gb"]),
        ("GB300", ["1g.35gb", "1g.35gb+me", "1g.70gb", "2g.70gb", "3g.139gb", "4g.139gb", "7g.278gb"]),
        ("H20", ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"]),
        ("PG506", ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb"]),
    ],
)
def test_new_products_have_the_published_profile_names(product: str, names: list[str]) -> None:
    assert names == [p.name for p in CATALOG.product(product).profiles]


def test_differences_between_a_driver_and_the_catalog_are_spelled_out() -> None:
    h200 = CATALOG.product("H200")
    profiles = list(h200.profiles)
    profiles[0] = dataclasses.replace(profiles[0], memory_mib=16000)
    extra = dataclasses.replace(profiles[1], id=99, name="1g.18gb+gfx")
    driver = dataclasses.replace(h200, profiles=(*profiles[:-1], extra), origin="driver")
    assert (
        "1g.18gb (id 19): memory MiB is 16000 on the driver, 16384 here",
        "the driver has 1g.18gb+gfx (id 99), the catalog does not",
        "the catalog has 7g.141gb (id 0), the driver does not",
    ) == differences(driver, h200)
    assert () == differences(h200, h200)


def test_round_half_away_from_zero_like_go() -> None:
    """H200's 3g profile is 70.5 GB by fraction: Go rounds to 71, Python's round() would say 70."""
    assert 71 == mig_memory_gb(65536, 143771)
    assert 23 == mig_memory_gb(21760, 183359)  # B200 1g: 22.5 -> 23


def test_pci_device_ids_map_to_one_product_each() -> None:
    assert "A100-SXM4-40GB" == getattr(CATALOG.by_pci_device_id(0x20B0), "name", None)
    assert "H100-80GB-HBM3" == getattr(CATALOG.by_pci_device_id(0x2330), "name", None)
    assert CATALOG.by_pci_device_id(0x27B8) is None  # L4: no MIG
    all_ids = [i for p in (*PRODUCTS, *CATALOG.plain) for i in p.pci_device_ids]
    assert len(all_ids) == len(set(all_ids))


def test_a_broken_catalog_is_a_catalog_error() -> None:
    with pytest.raises(CatalogError, match="the hardware catalog is broken"):
        load_catalog("layouts: {}\nproducts: {X: {layout: missing}}\n")


def test_the_wheel_carries_the_catalog_and_the_console_script(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            str(REPO),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("gpu_sharing-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert "sharing = sharing.cli:main" in archive.read(entry_points).decode()
    assert "sharing/mig/catalog.yaml" in names
    assert "sharing/py.typed" in names
    assert "sharing/labels/gfd.py" in names
