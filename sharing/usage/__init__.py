"""What the slices are doing: the usage sampler, whose processes are whose, each slice's window, and advice.

`sampler` runs on a thread of its own (I/O: NVML through the backend's usage reader, the host's
/proc, the pod list, the windows' file `store`); `cgroup`, `attribute`, `window`, `report`, `idle`,
`recommend` and `resize` are pure: which pod a process is, which slice a pod's processes count for,
what a slice used over the window, the report `sharing status --usage`, `/status` and the metrics
read, which slices became idle, and the config `sharing recommend` proposes from the right sizes.
"""

from sharing.usage.attribute import Attribution, HeldSlice, SliceUse, Unattributed, attribute, held_slices
from sharing.usage.report import SliceReport, UsageReport
from sharing.usage.sampler import UsageSampler

__all__ = [
    "Attribution",
    "HeldSlice",
    "SliceReport",
    "SliceUse",
    "Unattributed",
    "UsageReport",
    "UsageSampler",
    "attribute",
    "held_slices",
]
