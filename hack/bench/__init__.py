"""The performance bench: every figure measured through real parts, with targets.

    $(hack/venv.sh)/bin/python hack/bench [--quick] [--json PATH] [--fleet N] [--only PART,...]

It builds or reuses the Go binaries (hack/lab), starts what each part needs (etcd + kube-apiserver
with an audit log, the kubelet harness, a real node, a fleet of harnesses), runs `sharing agent` with
a ServiceAccount token bound to a pod on its node (as deploy/'s admission policy requires), measures,
and stops everything again, also on Ctrl-C or SIGTERM. Ratios to the Go stub device plugin are
taken in the same run, the two interleaved sample by sample. Each module's docstring says what it
measures and how:

- ``planner``: `plan_gpu` per call;  ``mutations``: NVML mutations vs destroy-all-and-recreate;
- ``listandwatch``: health change -> the kubelet's device manager, ours vs the stub;
- ``reconcile``: agent start, label change and ConfigMap edit through the harness and the API;
- ``allocate``: Allocate and GetPreferredAllocation admissions, ours vs the stub, and direct calls;
- ``idle``: an agent's memory, CPU and API requests while nothing changes;
- ``restart``: how long an agent restart leaves the kubelet refusing pods that ask for a slice;
- ``realnode``: pod start with and without a device, label change -> Node allocatable, on a real
  kubelet with the agent as its DaemonSet pod; the node's stop (what the demo's Ctrl-C runs);
- ``fleet``: N nodes on one API server: converge after a ConfigMap edit, idle API traffic, cost;
- ``trace``: a seeded MIG workload on four A100s through the real kube-scheduler, three ways (the
  best static layout on the device-plugin front-end, on-demand in policy order, in plain order).

The plumbing: ``cluster`` (the single-node control plane, harness and agent), ``labnode`` (a real
node with the agent's chart, pods started and timed), ``clients`` (API, watches, harness), ``procs``
(processes, /proc figures), ``expect`` (what a config should give, computed from the catalog),
``tracesim`` (the trace's pure half: trace, layouts, replay, statistics), ``report`` (targets,
budgets, table, JSON). A full run takes about 12 minutes on 2 cores plus 7 for ``trace``'s three
seeds; --quick about 5 (one seed). Needs root and the Go binaries (built once).
"""
