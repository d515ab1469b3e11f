"""A slice's right size: the smallest profile of its GPU that holds its peak memory with 10 % headroom
(and its SM p95 where known), table-driven over every MIG product of the catalog."""

from __future__ import annotations

import pytest

from sharing.mig import MIB, Basis, Product, Profile, default_catalog, right_size
from sharing.mig.rightsize import HEADROOM_PERCENT, candidates, extension

PRODUCTS = [p for p in default_catalog().products if p.profiles]
"""Every MIG product whose profiles the catalog knows (of the others, the driver's are used)."""
GIB = 1 << 30


def plain(product: Product) -> list[Profile]:
    return candidates(product)


def peak_for(profile: Profile) -> int:
    """The largest peak the profile holds with its headroom."""
    return profile.memory_mib * MIB * 100 // (100 + HEADROOM_PERCENT)


CASES = [
    pytest.param(product, profile, id=f"{product.name}-{profile.name}")
    for product in PRODUCTS
    for profile in plain(product)
]


@pytest.mark.parametrize(("product", "profile"), CASES)
def test_a_peak_that_fills_a_profile_with_its_headroom_is_sized_to_the_smallest_that_holds_it(
    product: Product, profile: Profile
) -> None:
    size = right_size(product, peak_for(profile), None, compute_slices=product.compute_slices)
    smallest = min(
        (p for p in plain(product) if p.memory_mib >= profile.memory_mib),
        key=lambda p: (p.compute_slices, p.memory_mib, p.size),
    )
    assert (smallest.name, Basis.MEMORY, None) == (size.profile, size.basis, size.compute_slices)
    # A MiB more, and the headroom needs a profile with more memory than this one (or none holds it).
    more = right_size(product, peak_for(profile) + MIB, None, compute_slices=product.compute_slices)
    bigger = [p.memory_mib for p in plain(product) if p.name == more.profile]
    assert more.profile is None or bigger[0] > profile.memory_mib


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_a_peak_larger_than_the_largest_profile_has_no_right_size_and_says_why(product: Product) -> None:
    largest = max(plain(product), key=lambda p: p.memory_mib)
    size = right_size(product, largest.memory_mib * MIB, None, compute_slices=product.compute_slices)
    assert size.profile is None
    assert size.why.startswith(f"no MIG profile of {product.name} holds ")


@pytest.mark.parametrize("product", PRODUCTS, ids=lambda p: p.name)
def test_the_sm_p95_asks_for_its_share_of_the_compute_slices_of_the_slice(product: Product) -> None:
    """A pod using 2 GiB on the largest instance, busy on 60 % of its SMs: it needs that share of
    the instance's compute slices, not the smallest profile its memory alone would fit."""
    largest = max(plain(product), key=lambda p: p.compute_slices)
    size = right_size(product, 2 * GIB, 0.6, compute_slices=largest.compute_slices)
    needed = 0.6 * largest.compute_slices
    assert size.basis is Basis.MEMORY_SM
    assert size.compute_slices == pytest.approx(needed)
    chosen = next(p for p in plain(product) if p.name == size.profile)
    assert chosen.compute_slices >= needed - 1e-9
    assert not any(
        needed - 1e-9 <= p.compute_slices < chosen.compute_slices and p.memory_mib * MIB >= 2.2 * GIB
        for p in plain(product)
    )
    memory_only = right_size(product, 2 * GIB, None, compute_slices=largest.compute_slices)
    assert next(p for p in plain(product) if p.name == memory_only.profile).compute_slices == min(
        p.compute_slices for p in plain(product) if p.memory_mib * MIB >= 2.2 * GIB
    )


@pytest.mark.parametrize(
    ("peak", "sm", "slices", "want"),
    [
        pytest.param(2 * GIB, None, 3, "1g.5gb", id="3g.20gb-using-2GiB-fits-a-1g.5gb"),
        pytest.param(2 * GIB, 0.3, 3, "1g.5gb", id="30%-of-a-3g-is-under-one-slice"),
        pytest.param(2 * GIB, 0.35, 3, "2g.10gb", id="35%-of-a-3g-needs-two-slices"),
        pytest.param(int(4.5 * GIB), None, 1, "1g.10gb", id="a-1g.5gb-nearly-full-needs-a-1g.10gb"),
        pytest.param(17 * GIB, None, 7, "3g.20gb", id="17GiB-and-headroom-in-19.5GiB"),
        pytest.param(18 * GIB, None, 7, "7g.40gb", id="18GiB-and-headroom-over-19.5GiB"),
        pytest.param(2 * GIB, 1.0, 7, "7g.40gb", id="a-whole-gpu-saturated-needs-all-seven"),
    ],
)
def test_an_a100_40gb(peak: int, sm: float | None, slices: int, want: str) -> None:
    a100 = default_catalog().product("A100-SXM4-40GB")
    assert want == right_size(a100, peak, sm, compute_slices=slices).profile


@pytest.mark.parametrize(
    "product",
    [p for p in PRODUCTS if any(extension(q.name) for q in p.profiles)],
    ids=lambda p: p.name,
)
def test_a_slice_with_media_extensions_is_sized_among_those_with_them(product: Product) -> None:
    extended = [q for q in product.profiles if extension(q.name)]
    for profile in extended:
        size = right_size(
            product, GIB, None, compute_slices=profile.compute_slices, family=extension(profile.name)
        )
        assert extension(size.profile) == extension(profile.name), profile.name
