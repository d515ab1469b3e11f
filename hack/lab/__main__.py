"""``python -m lab up|down``: a real node on the command line (the demo drives the same code).

    python hack/lab up [--name demo] [--node demo-gpu-node] [--k8s 1.34] [--kubelet 1.34]
                                                              # detached; prints the KUBECONFIG line
    python hack/lab down [--name demo]

Run from ``hack/`` (``cd hack && python -m lab ...``) or as ``python hack/lab ...``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python hack/lab`: make `import lab` work
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab import images
from lab.binaries import binaries
from lab.errors import ClusterError
from lab.node import RealNode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lab", description="a real single-node Kubernetes, in namespaces")
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start the node (detached) with the pause, toolbox and agent images")
    up.add_argument("--name", default="demo", help="the lab cluster's name (state in the cache)")
    up.add_argument("--node", default="demo-gpu-node", help="the Node's name")
    up.add_argument("--index", type=int, default=0, help="subnet 10.(200+INDEX).0.0/24")
    up.add_argument("--k8s", help="the cluster's Kubernetes release (default SHARING_K8S_VERSION, else 1.37)")
    up.add_argument("--kubelet", help="the node's kubelet from another release (1.34: version skew)")
    down = sub.add_parser("down", help="stop what 'up' started and remove its cgroups")
    down.add_argument("--name", default="demo")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            node = RealNode(args.name, args.node, index=args.index, k8s=args.k8s, kubelet=args.kubelet)
            node.up(images.all_images(binaries(args.k8s)))
            print(f"export KUBECONFIG={node.kubeconfig}")
            return 0
        try:
            node = RealNode.load(args.name)
        except FileNotFoundError:
            print(f"no node {args.name!r} is running", file=sys.stderr)
            return 0
        print(f"stopped {', '.join(node.down()) or 'nothing (it was not running)'}", file=sys.stderr)
        return 0
    except ClusterError as err:
        print(f"lab: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
