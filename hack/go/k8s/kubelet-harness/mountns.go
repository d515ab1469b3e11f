package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// The kubelet's device manager hard-codes its registration socket and
// checkpoint directory: NewManagerImpl uses pluginapi.KubeletSocket, which is
// /var/lib/kubelet/device-plugins/kubelet.sock, and it does not follow any
// --root-dir. To run the real code without touching the host's
// /var/lib/kubelet (which may belong to a real kubelet), the harness runs in
// its own mount namespace and bind-mounts a per-test host directory there.
//
// A mount namespace cannot be entered safely from a running Go program:
// unshare(CLONE_NEWNS) affects only the calling OS thread, and the Go runtime
// already has several. So the harness re-execs itself through util-linux's
// `unshare --mount`, which creates the namespace (with private propagation, so
// nothing leaks back to the host) and then execs us again in the same
// process: the PID the caller started stays the harness's PID, and signals
// reach it directly.

const nsEnv = "GPU_SHARING_HARNESS_IN_MOUNTNS"

// kubeletPluginDir is pluginapi.DevicePluginPath without the trailing slash.
const kubeletRoot = "/var/lib/kubelet"

var kubeletPluginDir = filepath.Join(kubeletRoot, "device-plugins")

// reexecInMountNamespace replaces the current process with
// `unshare --mount --propagation private <self> <args>` unless we are already
// inside that namespace. It only returns on error, or when already inside.
func reexecInMountNamespace() error {
	if os.Getenv(nsEnv) == "1" {
		return nil
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("the kubelet harness needs root (it creates a mount namespace and mounts over %s); run it as root", kubeletRoot)
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		return fmt.Errorf("util-linux 'unshare' not found in PATH: %w", err)
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("cannot find own executable: %w", err)
	}
	args := append([]string{"unshare", "--mount", "--propagation", "private", "--", self}, os.Args[1:]...)
	env := append(os.Environ(), nsEnv+"=1")
	return syscall.Exec(unshare, args, env)
}

// setupKubeletDir runs inside the private mount namespace. It puts a tmpfs on
// /var/lib/kubelet (so nothing of the host's kubelet state is visible or
// modified) and bind-mounts hostPluginDir onto /var/lib/kubelet/device-plugins.
// Plugins on the host create their sockets in hostPluginDir; the kubelet code
// sees them under the hard-coded path, and its kubelet.sock and checkpoint
// land in hostPluginDir where host processes (and tests) can see them.
func setupKubeletDir(hostPluginDir string) error {
	if os.Getenv(nsEnv) != "1" {
		return fmt.Errorf("internal error: not inside the harness mount namespace")
	}
	// Belt and braces: `unshare --propagation private` already did this.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make / rprivate: %w", err)
	}
	// The mount point must exist. If the host has no /var/lib/kubelet this
	// creates an empty directory there (the only change to the host tree).
	if err := os.MkdirAll(kubeletRoot, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", kubeletRoot, err)
	}
	if err := unix.Mount("tmpfs", kubeletRoot, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=16m"); err != nil {
		return fmt.Errorf("mount tmpfs on %s: %w", kubeletRoot, err)
	}
	if err := os.MkdirAll(kubeletPluginDir, 0o750); err != nil {
		return fmt.Errorf("create %s: %w", kubeletPluginDir, err)
	}
	if err := unix.Mount(hostPluginDir, kubeletPluginDir, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind-mount %s on %s: %w", hostPluginDir, kubeletPluginDir, err)
	}
	return nil
}
