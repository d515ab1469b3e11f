"""The subprocess side of the fake driver's tests: calls nvidia-ml-py's public wrappers by name.

Run with LD_LIBRARY_PATH at the fake driver and FAKE_NVML_STATE at a state file, it reads one JSON
request per line, `{"call": NAME, "args": [...]}`, calls `pynvml.NAME(*args)` and answers one JSON
line: `{"value": ...}` or `{"error": CODE}` (an NVMLError's `.value`), plus `"out"`: the values the
call left in the arrays and counters it was given. pynvml loads libnvidia-ml.so.1 once per process,
so each test gets its own worker. Arguments:
  {"h": ADDRESS}          a handle the worker returned before (handles are their addresses)
  {"placement": [S, N]}   ctypes.byref(c_nvmlGpuInstancePlacement_t(S, N))
  {"array": TYPE, "n": N} a caller-allocated array of pynvml.TYPE, returned in "out"
  {"uint": V}             ctypes.byref(c_uint(V)), returned in "out"
  {"struct": TYPE, "fields": {...}}  ctypes.byref(pynvml.TYPE(**fields)), returned in "out"
  {"gpm": [ID, ...], "samples": [H1, H2], "version": V}  a c_nvmlGpmMetricsGet_t (by value, as
                          nvmlGpmMetricsGet takes it) asking for those metrics between two samples
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

import pynvml


def encode(value: Any) -> Any:
    """JSON for pynvml's results: handles as {"h": address}, structs as dicts."""
    if isinstance(value, ctypes._Pointer):  # an opaque NVML handle
        address = ctypes.cast(value, ctypes.c_void_p).value
        return None if address is None else {"h": address}
    if isinstance(value, ctypes.Structure):
        return {name: encode(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes.Array):
        return [encode(item) for item in value]
    if isinstance(value, ctypes._SimpleCData):
        return value.value
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, (list, tuple)):
        return [encode(item) for item in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):  # pynvml's friendly objects
        return {k: encode(v) for k, v in vars(value).items()}
    return value


def decode(arg: Any, outputs: list[Any]) -> Any:
    if not isinstance(arg, dict):
        return arg
    if "h" in arg:
        return ctypes.cast(ctypes.c_void_p(arg["h"]), ctypes.POINTER(pynvml.struct_c_nvmlDevice_t))
    if "placement" in arg:
        start, size = arg["placement"]
        return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))
    if "array" in arg:
        array = (getattr(pynvml, arg["array"]) * arg["n"])()
        outputs.append(array)
        return array
    if "uint" in arg:
        number = ctypes.c_uint(arg["uint"])
        outputs.append(number)
        return ctypes.byref(number)
    if "gpm" in arg:
        get = pynvml.c_nvmlGpmMetricsGet_t()
        get.version = arg.get("version", pynvml.NVML_GPM_METRICS_GET_VERSION)
        get.numMetrics = len(arg["gpm"])
        first, second = (ctypes.c_void_p(h["h"]) for h in arg["samples"])
        get.sample1 = ctypes.cast(first, pynvml.c_nvmlGpmSample_t)
        get.sample2 = ctypes.cast(second, pynvml.c_nvmlGpmSample_t)
        for i, metric in enumerate(arg["gpm"]):
            get.metrics[i].metricId = metric
        return get
    if "struct" in arg:
        struct = getattr(pynvml, arg["struct"])()
        for name, value in arg.get("fields", {}).items():
            setattr(struct, name, value)
        outputs.append(struct)
        return ctypes.byref(struct)
    raise ValueError(f"unknown argument {arg!r}")


def answer(request: dict[str, Any]) -> dict[str, Any]:
    outputs: list[Any] = []
    args = [decode(a, outputs) for a in request.get("args", [])]
    try:
        value = getattr(pynvml, request["call"])(*args)
    except pynvml.NVMLError as err:
        return {"error": err.value, "text": str(err), "out": [encode(o) for o in outputs]}
    return {"value": encode(value), "out": [encode(o) for o in outputs]}


def main() -> None:
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
