"""The hardware catalog: lookup by the names people and NVML use, and data that agrees with itself."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sharing.catalog import Product, default_catalog, mig_memory_gb
from sharing.errors import CatalogError

CATALOG = default_catalog()
PRODUCTS = CATALOG.products
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("a100 sxm4 40gb", "A100-SXM4-40GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB-HBM3"),
        ("h100-80gb-hbm3", "H100-80GB-HBM3"),
        ("NVIDIA A100 80GB PCIe", "A100-PCIE-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-PCIE-40GB"),
        ("NVIDIA H100 NVL", "H100-NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200-NVL"),
        ("NVIDIA GH200 480GB", "GH200-96GB"),
        ("NVIDIA GH200 144G HBM3e", "GH200-144GB"),
        ("NVIDIA A30", "A30"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_products_are_found_by_nvml_and_catalog_names(name: str, expected: str) -> None:
    found = CATALOG.find(name)
    assert found is not None
    assert expected == found.name


def test_unknown_product_names_the_known_ones() -> None:
    with pytest.raises(CatalogError, match=r"unknown GPU product 'Tesla T4' \(known: A100-SXM4-40GB"):
        CATALOG.product("Tesla T4")


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_profile_names_derive_from_memory_as_nvidia_does(product: Product) -> None:
    """The NVML backend names profiles from NVML's memory sizes; the catalog must agree with itself."""
    for profile in product.profiles:
        gb = mig_memory_gb(profile.memory_mib, product.memory_mib)
        base = profile.name.split("+")[0]
        assert base.endswith(f".{gb}gb"), (profile.name, gb)


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_geometry_is_consistent(product: Product) -> None:
    for profile in product.profiles:
        assert profile.placements, profile.name
        for start in profile.placements:
            assert 0 <= start, (profile.name, start)
            assert start + profile.size <= product.memory_slices, (profile.name, start)
        assert profile.compute_slices <= product.compute_slices
        assert 1 <= profile.max_count <= len(profile.placements)
    assert len({p.name for p in product.profiles}) == len(product.profiles)
    assert len({p.id for p in product.profiles}) == len(product.profiles)


def test_round_half_away_from_zero_like_go() -> None:
    """H200's 3g profile is 70.5 GB by fraction: Go rounds to 71, Python's round() would say 70."""
    assert 71 == mig_memory_gb(65536, 143771)
    assert 23 == mig_memory_gb(21760, 183359)  # B200 1g: 22.5 -> 23


def test_pci_device_ids_map_to_products() -> None:
    assert "A100-SXM4-40GB" == getattr(CATALOG.by_pci_device_id(0x20B0), "name", None)
    assert "H100-80GB-HBM3" == getattr(CATALOG.by_pci_device_id(0x2330), "name", None)
    assert CATALOG.by_pci_device_id(0x1EB8) is None  # Tesla T4: no MIG
    all_ids = [i for p in PRODUCTS for i in p.pci_device_ids]
    assert len(all_ids) == len(set(all_ids))


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
    assert "sharing/catalog.yaml" in names
    assert "sharing/py.typed" in names
