"""gpu-sharing: one node agent that partitions NVIDIA GPUs (MIG, time-slicing) and advertises the slices."""

__version__ = "0.1.0"
