"""Agent settings: flag over environment over default, and clear errors for bad values."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sharing import settings


def parse(argv: list[str], env: dict[str, str]) -> settings.Settings:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    return settings.from_args(parser.parse_args(argv), env)


def test_flag_beats_environment_beats_default() -> None:
    env = {"SHARING_NODE_NAME": "from-env", "SHARING_CONFIGMAP": "env-cm", "SHARING_RESYNC_SECONDS": "60"}
    got = parse(["--node-name", "from-flag", "--ignored-xids", "13,43"], env)
    assert "from-flag" == got.node_name
    assert "env-cm" == got.configmap
    assert 60.0 == got.resync_seconds
    assert (13, 43) == got.ignored_xids
    assert "gpu-sharing" == got.namespace
    assert Path("/var/lib/kubelet/device-plugins") == got.device_plugin_dir
    assert Path("/") == got.driver_root
    assert (
        Path("/driver-root")
        == parse(["--node-name", "n"], {"SHARING_DRIVER_ROOT": "/driver-root"}).driver_root
    )


def test_the_kubelet_plugin_dirs_of_the_dra_front_end() -> None:
    default = parse(["--node-name", "n"], {})
    assert (Path("/var/lib/kubelet/plugins"), Path("/var/lib/kubelet/plugins_registry")) == (
        default.kubelet_plugins_dir,
        default.kubelet_registry_dir,
    )
    got = parse(
        ["--node-name", "n", "--kubelet-registry-dir", "/flag/registry"],
        {"SHARING_KUBELET_PLUGINS_DIR": "/env/plugins", "SHARING_KUBELET_REGISTRY_DIR": "/env/registry"},
    )
    assert (Path("/env/plugins"), Path("/flag/registry")) == (
        got.kubelet_plugins_dir,
        got.kubelet_registry_dir,
    )


def test_kubeconfig_falls_back_to_KUBECONFIG() -> None:
    assert "/k" == parse(["--node-name", "n"], {"KUBECONFIG": "/k"}).kubeconfig
    assert parse(["--node-name", "n"], {}).kubeconfig is None


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "the node name is required"),
        (["--node-name", "n", "--backend", "sim"], {}, "'sim' is not nvml"),
        (
            ["--node-name", "n"],
            {"SHARING_RESYNC_SECONDS": "soon"},
            "SHARING_RESYNC_SECONDS: 'soon' is not a valid",
        ),
        (
            ["--node-name", "n", "--device-list-strategy", "cdi"],
            {},
            "the strategies are envvar, volume-mounts",
        ),
        (["--node-name", "n", "--device-id-strategy", "name"], {}, "the ID strategy uuid or index"),
        (["--node-name", "n", "--http-port", "70000"], {}, "70000 is not a port"),
        (["--node-name", "n", "--allocation-policy", "random"], {}, "'random' is not distributed or packed"),
        (
            ["--node-name", "n"],
            {"SHARING_FRONTEND": "plugins"},
            "--frontend / SHARING_FRONTEND: 'plugins' is not a front-end: deviceplugin or dra",
        ),
    ],
    ids=["no-node", "backend", "env-number", "list-strategy", "id-strategy", "port", "policy", "frontend"],
)
def test_bad_settings_name_the_setting(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(argv, env)


def test_the_front_end_comes_from_the_flag_or_the_environment() -> None:
    assert "deviceplugin" == parse(["--node-name", "n"], {}).frontend
    assert "dra" == parse(["--node-name", "n"], {"SHARING_FRONTEND": "dra"}).frontend
    assert (
        "deviceplugin"
        == parse(["--node-name", "n", "--frontend", "deviceplugin"], {"SHARING_FRONTEND": "dra"}).frontend
    )


def parse_keeper(argv: list[str], env: dict[str, str]) -> settings.KeeperSettings:
    parser = argparse.ArgumentParser()
    settings.add_keeper_arguments(parser)
    return settings.keeper_from_args(parser.parse_args(argv), env)


def test_the_agent_and_its_mps_keeper_read_the_same_variables() -> None:
    env = {
        "SHARING_MPS_KEEPER_SOCKET": "/run/mps-keeper/keeper.sock",
        "SHARING_DRIVER_ROOT": "/driver-root",
        "SHARING_MPS_ROOT": "/run/nvidia/mps",
    }
    agent = parse(["--node-name", "n"], env)
    keeper = parse_keeper([], env)
    assert (agent.mps_keeper_socket, agent.driver_root, agent.mps_root) == (
        keeper.mps_keeper_socket,
        keeper.driver_root,
        keeper.mps_root,
    )
    assert Path("/k.sock") == parse_keeper(["--mps-keeper-socket", "/k.sock"], env).mps_keeper_socket
    assert parse(["--node-name", "n"], {"SHARING_MPS_KEEPER_SOCKET": ""}).mps_keeper_socket is None


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {}, "the socket is required: --mps-keeper-socket or SHARING_MPS_KEEPER_SOCKET"),
        (["--mps-keeper-socket", "/k"], {"SHARING_LOG_FORMAT": "xml"}, "log format 'xml' is not"),
    ],
    ids=["no-socket", "log-format"],
)
def test_bad_keeper_settings_name_the_setting(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_keeper(argv, env)


def test_usage_is_on_every_10_s_over_a_day_by_default() -> None:
    got = parse(["--node-name", "n", "--journal", "/state/journal.jsonl"], {})
    assert (True, 10.0, 86400.0, Path("/proc")) == (
        got.usage_enabled, got.usage_interval_seconds, got.usage_window, got.host_proc
    )  # fmt: skip
    assert Path("/state/usage.json") == got.usage_state
    assert (1800.0, False) == (got.usage_idle_after, got.usage_idle_events)


def test_idle_after_takes_durations_and_idle_events_a_boolean() -> None:
    got = parse(["--node-name", "n", "--usage-idle-after", "2h"], {"SHARING_USAGE_IDLE_EVENTS": "true"})
    assert (7200.0, True) == (got.usage_idle_after, got.usage_idle_events)
    assert 45.0 == parse(["--node-name", "n"], {"SHARING_USAGE_IDLE_AFTER": "45s"}).usage_idle_after


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("24h", 86400.0),
        ("120m", 7200.0),
        ("3600", 3600.0),
        ("7200s", 7200.0),
        ("168h", 604800.0),
        ("2.0h", 7200.0),
    ],
)
def test_the_usage_window_takes_durations(value: str, seconds: float) -> None:
    assert seconds == parse(["--node-name", "n"], {"SHARING_USAGE_WINDOW": value}).usage_window


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SHARING_USAGE_ENABLED": "maybe"}, "SHARING_USAGE_ENABLED: 'maybe' is not a valid usage enabled"),
        ({"SHARING_USAGE_INTERVAL_SECONDS": "0.5"}, "0.5 is less than 1 second"),
        ({"SHARING_USAGE_WINDOW": "2d"}, "SHARING_USAGE_WINDOW: '2d' is not a valid usage window"),
        ({"SHARING_USAGE_WINDOW": "30m"}, "1800 s is not a whole number of hours from 1h to 168h"),
        ({"SHARING_USAGE_WINDOW": "169h"}, "is not a whole number of hours from 1h to 168h"),
        ({"SHARING_USAGE_WINDOW": "1.5h"}, "is not a whole number of hours"),
        (
            {"SHARING_USAGE_IDLE_AFTER": "soon"},
            "SHARING_USAGE_IDLE_AFTER: 'soon' is not a valid usage idle after",
        ),
        ({"SHARING_USAGE_IDLE_AFTER": "0"}, "SHARING_USAGE_IDLE_AFTER: 0 s is less than 1 s"),
        ({"SHARING_USAGE_IDLE_EVENTS": "sometimes"}, "'sometimes' is not a valid usage idle events"),
    ],
    ids=[
        "enabled",
        "interval",
        "unit",
        "too-short",
        "too-long",
        "not-whole-hours",
        "idle-after-word",
        "idle-after-zero",
        "idle-events",
    ],
)
def test_bad_usage_settings_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(["--node-name", "n"], env)
