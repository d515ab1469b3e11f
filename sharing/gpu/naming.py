"""MIG profile names derived from what NVML reports, the way NVIDIA's own tools derive them.

The rule itself lives with the catalog (`sharing.mig.profile_name`), which names its own profiles the
same way; this module keeps the compute-instance side the backend needs.
"""

from __future__ import annotations

__all__ = ["CI_ENUM_FOR_SLICES"]

# Compute slices -> the compute-instance profile enum of a CI spanning a GPU instance of that size.
CI_ENUM_FOR_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}
