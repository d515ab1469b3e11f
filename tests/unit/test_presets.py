"""The presets in profiles/: generated from the catalog, up to date, valid on every product they name."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from sharing.config import parse_config, parse_configmap
from sharing.config.spec import MigMode, MigStrategy, Selector
from sharing.mig.catalog import default_catalog

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml"))


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_presets", ROOT / "hack" / "gen-presets.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _gen()


def test_the_expected_presets_exist() -> None:
    expected = {"all-disabled", "all-enabled", "all-1g", "all-2g", "all-3g", "all-balanced", "all-replicas-2",
                "all-replicas-4", "all-replicas-8", "a100-mig-h100-time-sliced"}  # fmt: skip
    assert set(PRESETS) == expected


def test_the_committed_files_are_up_to_date() -> None:
    assert GEN.main(["--check"]) == 0


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_validates_on_every_product_it_names(name: str) -> None:
    text = (ROOT / "profiles" / f"{name}.yaml").read_text()
    assert text.startswith(f"# {name}: ")
    catalog = default_catalog()
    for product in GEN.named_products(text, catalog):
        (config,) = parse_config(name, text, products=[product])
        assert config.name == name


def test_the_configmap_holds_every_preset() -> None:
    manifest = yaml.safe_load((ROOT / "deploy" / "presets-configmap.yaml").read_text())
    assert (manifest["kind"], manifest["metadata"]["name"], manifest["metadata"]["namespace"]) == (
        "ConfigMap",
        "gpu-sharing-presets",
        "gpu-sharing",
    )
    assert sorted(manifest["data"]) == PRESETS
    assert parse_configmap(manifest["data"]).names == tuple(PRESETS)


def test_all_balanced_matches_mig_manager() -> None:
    (config,) = parse_config("all-balanced", (ROOT / "profiles" / "all-balanced.yaml").read_text())
    layouts = {r.devices.product: dict(r.instances) for r in config.rules}
    assert layouts["A100-SXM4-40GB"] == {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
    assert layouts["A30"] == {"1g.6gb": 2, "2g.12gb": 1}
    assert layouts["RTX-PRO-6000"] == {"1g.24gb": 2, "2g.48gb": 1}
    assert layouts["H200"] == {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1}
    with_1g_and_2g = {
        p.name for p in default_catalog().products if {1, 2} <= {q.compute_slices for q in p.profiles}
    }
    assert set(layouts) == with_1g_and_2g


def test_all_1g_uses_the_maximum_count_of_the_smallest_profile() -> None:
    (config,) = parse_config("all-1g", (ROOT / "profiles" / "all-1g.yaml").read_text())
    layouts = {r.devices.product: r.instances for r in config.rules}
    assert layouts["A100-SXM4-80GB"] == (("1g.10gb", 7),)
    assert layouts["A30"] == (("1g.6gb", 4),)


def test_the_demo_preset() -> None:
    (config,) = parse_config("x", (ROOT / "profiles" / "a100-mig-h100-time-sliced.yaml").read_text())
    assert config.mig_strategy is MigStrategy.MIXED
    assert not config.rename_by_default
    a100 = config.rule_for(0, "NVIDIA A100-SXM4-40GB")
    h100 = config.rule_for(0, "NVIDIA H100 80GB HBM3")
    assert a100 is not None
    assert h100 is not None
    assert a100.instances == (("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1))
    assert (h100.mig, h100.replicas.for_kind("gpu")) == (MigMode.DISABLED, 4)
    assert config.rule_for(0, "Tesla T4") is None
    assert all(r.devices != Selector(all=True) for r in config.rules)


def test_check_reports_stale_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(GEN, "PROFILES", tmp_path / "profiles")
    monkeypatch.setattr(GEN, "CONFIGMAP", tmp_path / "presets-configmap.yaml")
    monkeypatch.setattr(GEN, "ROOT", tmp_path)
    assert GEN.main(["--check"]) == 1
    assert "run `python hack/gen-presets.py`" in capsys.readouterr().err
    assert GEN.main([]) == 0
    assert GEN.main(["--check"]) == 0
