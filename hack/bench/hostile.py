"""A hostile ConfigMap key: what parsing it costs the agent in memory and time.

Each shape is one extra key beside a normal config, just under the 1 MiB a ConfigMap may hold:
a list of 480,000 zeros (the shape that OOM-killed the agent at its 256 Mi limit), 64,000 small
mappings, the same under 256 KiB, lists nested 100,000 deep, an alias bomb, and the largest config
within the limits (6,600 bad rules, all checked). Each is parsed by `parse_configmap`, as the agent
does, in a fresh Python process: the peak RSS (VmHWM) above the RSS just before the parse, and the
wall time. The normal config must still parse.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.report import Results, say

ROOT = Path(__file__).resolve().parents[2]
NORMAL = "version: v1\ngpus:\n  - devices: all\n    replicas: 2\n"
BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [" + ", ".join([f"*{p}"] * 10) + "]\n" for p, c in zip("abcdef", "bcdefg", strict=True)
)
SHAPES = {
    "list_940kb": "version: v1\ngpus: [" + ",".join(["0"] * 480_000) + "]\n",
    "mappings_900kb": "version: v1\ngpus:\n" + "- {gpu: 1234}\n" * 64_000,
    # Under the limit of one config's bytes (256 KiB): the streaming count refuses them.
    "list_250kb": "version: v1\ngpus: [" + ",".join(["0"] * 125_000) + "]\n",
    "mappings_250kb": "version: v1\ngpus:\n" + "- {a: 1}\n" * 29_000,
    "nested_200kb": "version: v1\ngpus: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "alias_bomb": BOMB,
    # The most a config may hold: 6,600 rules with an unknown key each (19,803 nodes), all parsed.
    "bad_rules_at_limit": "version: v1\ngpus:\n" + "- {gpu: 1}\n" * 6_600,
}
CHILD = """
import json, re, sys, time
from pathlib import Path
from sharing.config import parse_configmap
def kb(field):
    return int(re.search(field + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
data = json.loads(sys.stdin.read())
before = kb("VmRSS")
start = time.perf_counter()
configs = parse_configmap(data)
seconds = time.perf_counter() - start
peak = kb("VmHWM")
errors = [str(p) for p in configs.errors]
print(json.dumps({"mb": (peak - before) / 1024, "s": seconds, "names": configs.names, "errors": errors}))
"""


def measure(shape: str, root: Path = ROOT) -> dict[str, object]:
    """Parse the normal config and one hostile key in a fresh process (`sharing` imported from `root`)."""
    data = json.dumps({"mine": NORMAL, "hostile": SHAPES[shape]})
    out = subprocess.run(
        [sys.executable, "-c", CHILD], input=data, capture_output=True, text=True, check=True, cwd=root
    )
    figures: dict[str, object] = json.loads(out.stdout)
    return figures


def bench_hostile(results: Results) -> None:
    """hostile_configmap_mb and _s: the worst shape; each shape's figures beside them."""
    worst_mb = worst_s = 0.0
    for shape, text in SHAPES.items():
        figures = measure(shape)
        mb, seconds = float(figures["mb"]), float(figures["s"])  # type: ignore[arg-type]
        first = figures["errors"][0] if figures["errors"] else "accepted"  # type: ignore[index]
        say(f"hostile {shape} ({len(text)} bytes): {mb:.1f} MB, {seconds:.3f} s: {first}"[:300])
        if figures["names"] != ["mine"]:
            raise AssertionError(f"the normal config was lost beside the hostile {shape} key: {figures}")
        results.add(f"hostile_{shape}_mb", mb)
        results.add(f"hostile_{shape}_s", seconds)
        worst_mb, worst_s = max(worst_mb, mb), max(worst_s, seconds)
    results.add("hostile_configmap_mb", worst_mb)
    results.add("hostile_configmap_s", worst_s)
