"""MIG profile names derived from what NVML reports, the way NVIDIA's own tools derive them.

Pure. NVML gives a GPU-instance profile's enum, compute slice count and memory; the user-facing name
(`3g.20gb`, `1g.10gb+me`) is built from those as go-nvlib does, so names match `nvidia-smi` and
mig-parted on every product, including ones the catalog has not seen yet.
"""

from __future__ import annotations

from sharing.catalog import mig_memory_gb

# GPU-instance profile enum (nvml.h) -> name suffix; enums not listed have none.
_SUFFIX = {
    0x7: "+me",
    0x8: "+me",  # 1_SLICE_REV1, 2_SLICE_REV1
    0xA: "+gfx",
    0xB: "+gfx",
    0xC: "+gfx",
    0x11: "+gfx",  # *_GFX
    0xD: "-me",
    0xE: "-me",  # *_NO_ME
    0xF: "+me.all",
    0x10: "+me.all",  # *_ALL_ME
}

# Compute slices -> the compute-instance profile enum of a CI spanning a GPU instance of that size.
CI_ENUM_FOR_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}


def gi_profile_name(enum: int, compute_slices: int, memory_mib: int, total_memory_mib: int) -> str:
    """`<G>g.<GB>gb[suffix]` for a GPU-instance profile as NVML describes it."""
    return f"{compute_slices}g.{mig_memory_gb(memory_mib, total_memory_mib)}gb{_SUFFIX.get(enum, '')}"
