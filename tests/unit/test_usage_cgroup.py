"""Which pod and container a process is, from its /proc/<pid>/cgroup, in every layout the kubelet makes."""

from __future__ import annotations

import pytest

from sharing.usage.cgroup import PodProcess, pod_of

UID = "0f3c8a52-6e1d-4b7a-9c2e-5d4f6a7b8c9d"
SYSTEMD_UID = UID.replace("-", "_")
CTR = "4b825dc642cb6eb9a060e54bf8d69288fbee4904" + "a1b2c3d4e5f60718293a4b5c"
STATIC_UID = "6d5c4b3a29181706f5e4d3c2b1a09f8e"  # a static pod's: its config hash


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            # The lab's real nodes: cgroup v1 (a line per hierarchy), cgroupfs under the kubelet's cgroupRoot,
            # and runc's cgroup in the controller-less v2 hierarchy.
            f"12:pids:/gpu-sharing-test/kubepods/besteffort/pod{UID}/{CTR}\n"
            f"4:memory:/gpu-sharing-test/kubepods/besteffort/pod{UID}/{CTR}\n"
            f"1:name=systemd:/gpu-sharing-test/kubepods/besteffort/pod{UID}/{CTR}\n"
            f"0::/gpu-sharing-test/kubepods/besteffort/pod{UID}/{CTR}\n",
            PodProcess(UID, CTR),
            id="v1-cgroupfs-under-a-cgroup-root",
        ),
        pytest.param(
            f"0::/kubepods/burstable/pod{UID}/{CTR}\n", PodProcess(UID, CTR), id="v2-cgroupfs-burstable"
        ),
        pytest.param(f"0::/kubepods/pod{UID}/{CTR}\n", PodProcess(UID, CTR), id="v2-cgroupfs-guaranteed"),
        pytest.param(
            f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{SYSTEMD_UID}.slice/"
            f"cri-containerd-{CTR}.scope\n",
            PodProcess(UID, CTR),
            id="v2-systemd-containerd",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-{CTR}.scope\n",
            PodProcess(UID, CTR),
            id="v2-systemd-guaranteed-crio",
        ),
        pytest.param(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/docker-{CTR}.scope",
            PodProcess(UID, CTR),
            id="v2-systemd-docker-no-newline",
        ),
        pytest.param(
            # Read from another cgroup namespace (the agent's container): relative to its own root.
            f"0::/../../besteffort/pod{UID}/{CTR}\n",
            PodProcess(UID, CTR),
            id="v2-from-another-cgroup-namespace",
        ),
        pytest.param(
            f"0::/kubepods/besteffort/pod{STATIC_UID}/{CTR}\n", PodProcess(STATIC_UID, CTR), id="static-pod"
        ),
        pytest.param(f"0::/kubepods/besteffort/pod{UID}\n", PodProcess(UID, None), id="the-pods-own-cgroup"),
        pytest.param(
            # A pod-level line first, the container's later: the container is found.
            f"5:cpu:/kubepods/besteffort/pod{UID}\n0::/kubepods/besteffort/pod{UID}/{CTR}\n",
            PodProcess(UID, CTR),
            id="container-on-a-later-line",
        ),
        pytest.param("0::/system.slice/containerd.service\n", None, id="a-host-daemon"),
        pytest.param("0::/user.slice/user-0.slice/session-3.scope\n", None, id="a-login-session"),
        pytest.param("0::/kubepods/besteffort/podnot-a-uid/abc\n", None, id="not-a-uid"),
        pytest.param("", None, id="empty"),
        pytest.param("garbage without colons\n\x00\xff", None, id="garbage"),
    ],
)
def test_pod_of(text: str, expected: PodProcess | None) -> None:
    assert expected == pod_of(text)
