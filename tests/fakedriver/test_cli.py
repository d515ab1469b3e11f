"""`sharing sim`, `sharing export` and `sharing apply` as a person or a script uses them (fake driver)."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import structlog

from sharing.cli import main
from sharing.gpu import simstate
from sharing.kubelet.api import podresources_v1_pb2 as api
from sharing.kubelet.api import podresources_v1_pb2_grpc as api_grpc

CONFIG = """\
version: v1
migStrategy: mixed
gpus:
  - devices: [0]
    mig: {3g.20gb: 2}
  - devices: all
    replicas: 2
"""


@pytest.fixture(autouse=True)
def _fresh_logging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SHARING_JOURNAL", str(tmp_path / "journal.jsonl"))
    yield
    structlog.reset_defaults()  # `sharing apply` configured logging to this test's captured stderr


def driver(state: Path) -> list[str]:
    """The flag that names the fake driver's root (the state is <root>/var/lib/fake-nvidia/gpus.json)."""
    return ["--driver-root", str(state.parents[3])]


@pytest.fixture
def state(state: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = state
    assert main(["sim", "init", "--sim-state", str(path), "--gpus", "A100-SXM4-40GB,T4:1"]) == 0
    assert capsys.readouterr().out.count("GPU-") == 2
    return path


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG)
    return path


def test_export_json_shape(
    state: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARING_BACKEND", "nvml")
    monkeypatch.setenv("SHARING_DRIVER_ROOT", str(state.parents[3]))
    assert main(["export", "--json"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert [(g["index"], g["product"], g["migEnabled"], g["instances"]) for g in gpus] == [
        (0, "NVIDIA A100-SXM4-40GB", False, []),
        (1, "Tesla T4", False, []),
    ]


def test_apply_then_export(state: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sim = [*driver(state)]
    assert main(["apply", "--config", str(config), "--name", "small", *sim, "--no-kubelet", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [g["outcome"] for g in report["gpus"]] == ["applied", "unchanged"]
    assert report["gpus"][0]["steps"] == ["enable MIG", "create 3g.20gb@0", "create 3g.20gb@4"]
    assert main(["export", *sim, "--json"]) == 0
    instances = json.loads(capsys.readouterr().out)["gpus"][0]["instances"]
    assert [(i["profile"], i["start"], i["size"], i["busy"]) for i in instances] == [
        ("3g.20gb", 0, 4, False),
        ("3g.20gb", 4, 4, False),
    ]
    busy = instances[1]["uuid"]
    assert main(["sim", "busy", "--sim-state", str(state), "--uuid", busy]) == 0
    assert main(["export", *sim]) == 0
    assert f"{busy}  busy" in capsys.readouterr().out


def test_dry_run_prints_the_plan_and_changes_nothing(
    state: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["apply", "--config", str(config), "--name", "x", *driver(state)]
    assert main([*args, "--no-kubelet", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "planned" in out
    assert "2. create 3g.20gb@0" in out
    assert "dry run: nothing was changed" in out
    assert simstate.counters(state) == simstate.Counters(0, 0)


def test_could_not_apply_is_exit_1_with_the_reason(
    state: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    simstate.set_busy(state, simstate.read(state)["gpus"][0]["uuid"], True)
    args = ["apply", "--config", str(config), "--name", "x", *driver(state)]
    assert main([*args, "--no-kubelet"]) == 1
    assert "NVIDIA A100-SXM4-40GB" in (out := capsys.readouterr().out)
    assert "blocked: the GPU is in use" in out


def test_apply_from_a_configmap_ignores_other_broken_keys(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As in the agent, one bad config in the ConfigMap does not block applying another."""
    good = "\n".join("    " + line for line in CONFIG.splitlines())
    manifest = tmp_path / "cm.yaml"
    manifest.write_text(
        "kind: ConfigMap\nmetadata: {name: c}\ndata:\n"
        f"  good: |\n{good}\n  broken: |\n    version: v1\n    gpus: [{{devices: all, replicas: 0}}]\n"
    )
    args = [
        "apply",
        "--config",
        str(manifest),
        *driver(state),
        "--no-kubelet",
        "--json",
    ]
    assert main([*args, "--name", "good"]) == 0
    assert ["applied", "unchanged"] == [g["outcome"] for g in json.loads(capsys.readouterr().out)["gpus"]]
    assert main([*args, "--name", "broken"]) == 1
    assert "broken: gpus[0].replicas" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["export", "--backend", "sim"], "invalid choice", id="unknown-backend"),
        pytest.param(
            ["sim", "init", "--sim-state", "s.json", "--gpus", "GeForce 256"], "cannot play", id="product"
        ),
        pytest.param(["sim", "init", "--sim-state", "s.json", "--gpus", "T4:0"], "PRODUCT:COUNT", id="count"),
        pytest.param(["sim", "init", "--gpus", "T4"], "SHARING_SIM_STATE", id="sim-without-state-file"),
        pytest.param(["apply", "--config", "missing.yaml", "--name", "x"], "cannot read", id="no-config"),
    ],
)
def test_usage_errors_are_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_driver_root_without_a_driver_is_exit_1_saying_where_it_looked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", "--driver-root", str(tmp_path)]) == 1
    assert f"no libnvidia-ml.so.1 under the driver root {tmp_path} (looked in" in capsys.readouterr().err


def test_sim_and_export_read_their_paths_from_the_environment(
    state: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHARING_SIM_STATE", str(state))
    monkeypatch.setenv("SHARING_DRIVER_ROOT", str(state.parents[3]))
    assert main(["sim", "init", "--gpus", "T4:2"]) == 0
    capsys.readouterr()
    assert main(["export", "--json"]) == 0
    assert [g["product"] for g in json.loads(capsys.readouterr().out)["gpus"]] == ["Tesla T4", "Tesla T4"]


def test_sim_hooks(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpu = simstate.read(state)["gpus"][0]["uuid"]
    assert main(["sim", "xid", "--sim-state", str(state), "--uuid", gpu, "--xid", "79"]) == 0
    assert simstate.read(state)["events"][-1] == {"seq": 1, "gpu": 0, "xid": 79, "gi": None, "ci": None}
    assert main(["sim", "reset", "--sim-state", str(state), "--uuid", gpu]) == 0
    assert capsys.readouterr().out == f"reset {gpu}\n"
    assert main(["sim", "idle", "--sim-state", str(state), "--uuid", "GPU-nope"]) == 1


def test_sim_latency_sets_merges_and_clears_the_states_latencies(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = ["sim", "latency", "--sim-state", str(state)]
    assert main([*sim, "--realistic", "nvmlGpuInstanceDestroy=0", "nvmlDeviceGetCount_v2=0.01"]) == 0
    wanted = {**simstate.REALISTIC_LATENCIES, "nvmlDeviceGetCount_v2": 0.01}
    del wanted["nvmlGpuInstanceDestroy"]
    assert wanted == simstate.read(state)["latencies"]
    assert "nvmlDeviceCreateGpuInstanceWithPlacement  0.6 s" in capsys.readouterr().out
    assert main([*sim, "nvmlGpuInstanceDestroy=0.5"]) == 0  # merged into what is there
    assert {**wanted, "nvmlGpuInstanceDestroy": 0.5} == simstate.read(state)["latencies"]
    assert main([*sim, "--clear"]) == 0
    assert {} == simstate.read(state)["latencies"]
    assert "no latencies" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("item", "message"),
    [
        pytest.param("nvmlGpuInstanceDestroy", "is not FUNCTION=SECONDS", id="no-seconds"),
        pytest.param("nvmlGpuInstanceDestroy=soon", "is not FUNCTION=SECONDS", id="not-a-number"),
        pytest.param("nvmlGpuInstanceDestroy=-1", "not a number of seconds in 0..60", id="negative"),
        pytest.param("nvmlGpuInstanceDestroy=nan", "is not FUNCTION=SECONDS", id="nan"),
        pytest.param("cudaMalloc=1", "not an NVML function name", id="not-nvml"),
    ],
)
def test_a_bad_latency_is_a_usage_error_and_changes_nothing(
    state: Path, item: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "latency", "--sim-state", str(state), "nvmlDeviceSetMigMode=1"]) == 0
    assert main(["sim", "latency", "--sim-state", str(state), item]) == 2
    assert message in capsys.readouterr().err
    assert {"nvmlDeviceSetMigMode": 1.0} == simstate.read(state)["latencies"]


def test_a_lost_gpu_is_left_out_of_export_and_found_again(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = [*driver(state)]
    capsys.readouterr()
    assert main(["sim", "lost", "--sim-state", str(state), "--gpu", "1"]) == 0
    assert capsys.readouterr().out.startswith("GPU 1 (GPU-")
    assert main(["export", *sim, "--json"]) == 0
    assert ["NVIDIA A100-SXM4-40GB"] == [g["product"] for g in json.loads(capsys.readouterr().out)["gpus"]]
    assert main(["sim", "found", "--sim-state", str(state), "--gpu", "1"]) == 0
    assert main(["sim", "lost", "--sim-state", str(state), "--gpu", "7"]) == 1
    assert "no simulated GPU 7" in capsys.readouterr().err
    assert main(["export", *sim, "--json"]) == 0
    assert 2 == len(json.loads(capsys.readouterr().out)["gpus"])


MIG_PARTED_LAYOUT = """\
version: v1
migStrategy: mixed
gpus:
  - devices: [0]
    mig: {3g.20gb: 1, 2g.10gb: 1, 1g.5gb+me: 1, 1g.5gb: 1}
  - devices: [1]
    mig: {1g.10gb: 7}
"""


def test_export_as_mig_parted_applies_back_to_the_same_layout(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `export --format mig-parted` writes, `apply` (and mig-parted) take back to the same layout."""
    assert main(["sim", "init", "--sim-state", str(state), "--gpus", "A100-SXM4-40GB,H100-80GB-HBM3,T4"]) == 0
    sim = [*driver(state)]
    layout = tmp_path / "layout.yaml"
    layout.write_text(MIG_PARTED_LAYOUT)
    assert main(["apply", "--config", str(layout), "--name", "layout", *sim, "--no-kubelet"]) == 0
    capsys.readouterr()
    assert main(["export", *sim, "--format", "mig-parted", "--name", "snapshot"]) == 0
    exported = capsys.readouterr().out
    assert exported.startswith("version: v1\nmig-configs:\n  snapshot:\n  - device-filter: '0x20B010DE'\n")
    assert "      1g.5gb+me: 1\n" in exported
    snapshot = tmp_path / "snapshot.yaml"
    snapshot.write_text(exported)
    before = simstate.counters(state)
    args = ["apply", "--config", str(snapshot), "--name", "snapshot", *sim, "--no-kubelet", "--json"]
    assert main(args) == 0
    assert ["unchanged", "unchanged", "unchanged"] == [
        g["outcome"] for g in json.loads(capsys.readouterr().out)["gpus"]
    ]
    assert before == simstate.counters(state)


class _HeldByTrainer:
    """A kubelet's PodResources that lists one pod holding one MIG device."""

    def __init__(self, device: str) -> None:
        self.device = device

    def List(self, request: object, context: object) -> object:
        devices = [api.ContainerDevices(resource_name="nvidia.com/mig-3g.20gb", device_ids=[self.device])]
        container = api.ContainerResources(name="main", devices=devices)
        return api.ListPodResourcesResponse(
            pod_resources=[api.PodResources(name="trainer", namespace="ml", containers=[container])]
        )

    def GetAllocatableResources(self, request: object, context: object) -> object:
        return api.AllocatableResourcesResponse()

    def Get(self, request: object, context: object) -> object:
        return api.GetPodResourcesResponse()


ALL_1G = "version: v1\nmigStrategy: mixed\ngpus:\n  - devices: [0]\n    mig: {1g.5gb: 7}\n"


def test_apply_keeps_what_pods_hold_and_destroys_nothing_when_it_cannot_tell(
    state: Path, config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sim = [*driver(state)]
    assert main(["apply", "--config", str(config), "--name", "x", *sim, "--no-kubelet"]) == 0
    capsys.readouterr()
    held = simstate.read(state)["gpus"][0]["gpuInstances"][0]["computeInstances"][0]["uuid"]
    wanted = tmp_path / "all-1g.yaml"
    wanted.write_text(ALL_1G)
    apply_1g = ["apply", "--config", str(wanted), "--name", "all-1g", *sim, "--json"]
    # No kubelet answers: every device counts as in use, nothing is destroyed.
    before = simstate.counters(state)
    assert main([*apply_1g, "--pod-resources-socket", str(tmp_path / "absent.sock")]) == 1
    out = capsys.readouterr()
    assert "every device counts as in use, so none is destroyed" in out.err
    assert "blocked" == json.loads(out.out)["gpus"][0]["outcome"]
    assert before.mutations == simstate.counters(state).mutations
    # The kubelet says a pod holds one 3g: it stays, the change waits for it.
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    api_grpc.add_PodResourcesListerServicer_to_server(_HeldByTrainer(held), server)  # type: ignore[no-untyped-call]
    socket = tmp_path / "pr.sock"
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    try:
        assert main([*apply_1g, "--pod-resources-socket", str(socket)]) == 1
    finally:
        server.stop(None)
    report = json.loads(capsys.readouterr().out)["gpus"][0]
    assert ("blocked", [held]) == (report["outcome"], report["blockers"])
    held_now = [
        ci["uuid"] for gi in simstate.read(state)["gpus"][0]["gpuInstances"] for ci in gi["computeInstances"]
    ]
    assert held in held_now
