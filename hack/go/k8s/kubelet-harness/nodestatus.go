package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
)

// nodeSyncer plays the kubelet's node-status role for one Node: it registers
// the Node when missing (like kubelet's registerWithAPIServer) and copies the
// device manager's capacity/allocatable into status.capacity/allocatable
// through the nodes/status subresource, with the semantics of the kubelet's
// nodestatus.MachineInfo setter:
//   - capacity[r] = #healthy + #unhealthy, allocatable[r] = #healthy;
//   - a resource GetCapacity reports as removed gets capacity 0 and
//     allocatable 0 (kept as an explicit 0, never deleted), so users can
//     tell "device-plugin resource with nothing left" from "unknown".
//
// The kubelet syncs every nodeStatusUpdateFrequency (10s); we check at once
// when the device manager's resources change and otherwise every
// --node-status-interval (500ms), and PATCH only when something differs, so
// tests see changes quickly and an idle harness costs the apiserver one GET
// per interval (a fleet of harnesses runs with the kubelet's 10s).
type nodeSyncer struct {
	client   kubernetes.Interface
	nodeName string
	k        *fakeKubelet
}

func newNodeSyncer(kubeconfig, nodeName string, k *fakeKubelet) (*nodeSyncer, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %s: %w", kubeconfig, err)
	}
	cfg.UserAgent = "gpu-sharing-kubelet-harness"
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	return &nodeSyncer{client: cs, nodeName: nodeName, k: k}, nil
}

func (n *nodeSyncer) run(ctx context.Context, logger klog.Logger, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	lastErr := ""
	for {
		// Taken before the sync reads the state, so a change during the sync is not missed.
		_, changed := n.k.state.snapshot()
		err := n.syncOnce(ctx, logger)
		// Log errors once per distinct message (the apiserver may be down for
		// a while in restart tests), and log the recovery.
		switch {
		case err != nil && err.Error() != lastErr:
			logger.Error(err, "Node status sync failed; will retry", "node", n.nodeName)
			lastErr = err.Error()
		case err == nil && lastErr != "":
			logger.Info("Node status sync recovered", "node", n.nodeName)
			lastErr = ""
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-changed:
		}
	}
}

func (n *nodeSyncer) syncOnce(ctx context.Context, logger klog.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	node, err := n.client.CoreV1().Nodes().Get(ctx, n.nodeName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		node, err = n.register(ctx, logger)
	}
	if err != nil {
		return err
	}

	snap, _ := n.k.state.snapshot()
	capPatch := map[string]string{}
	allocPatch := map[string]string{}
	for name, info := range snap.Resources {
		rn := v1.ResourceName(name)
		want := resource.NewQuantity(info.Capacity, resource.DecimalSI)
		wantAlloc := resource.NewQuantity(info.Allocatable, resource.DecimalSI)
		if have, ok := node.Status.Capacity[rn]; !ok || have.Cmp(*want) != 0 {
			capPatch[name] = want.String()
		}
		if have, ok := node.Status.Allocatable[rn]; !ok || have.Cmp(*wantAlloc) != 0 {
			allocPatch[name] = wantAlloc.String()
		}
	}
	if len(capPatch) == 0 && len(allocPatch) == 0 {
		return nil
	}
	status := map[string]any{}
	if len(capPatch) > 0 {
		status["capacity"] = capPatch
	}
	if len(allocPatch) > 0 {
		status["allocatable"] = allocPatch
	}
	body, _ := json.Marshal(map[string]any{"status": status})
	if _, err := n.client.CoreV1().Nodes().Patch(ctx, n.nodeName, types.StrategicMergePatchType, body, metav1.PatchOptions{}, "status"); err != nil {
		return fmt.Errorf("patch node status: %w", err)
	}
	logger.Info("Updated node status", "node", n.nodeName, "capacity", capPatch, "allocatable", allocPatch)
	return nil
}

// register creates the Node with a status that looks like a real kubelet's
// first report: machine capacity, a Ready condition and nodeInfo. Status is
// ignored on create, so it is written through nodes/status afterwards.
func (n *nodeSyncer) register(ctx context.Context, logger klog.Logger) (*v1.Node, error) {
	node := &v1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name: n.nodeName,
			Labels: map[string]string{
				v1.LabelHostname:   n.nodeName,
				v1.LabelOSStable:   runtime.GOOS,
				v1.LabelArchStable: runtime.GOARCH,
			},
		},
	}
	created, err := n.client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		created, err = n.client.CoreV1().Nodes().Get(ctx, n.nodeName, metav1.GetOptions{})
	}
	if err != nil {
		return nil, fmt.Errorf("register node: %w", err)
	}
	created.Status = machineStatus(n.nodeName)
	updated, err := n.client.CoreV1().Nodes().UpdateStatus(ctx, created, metav1.UpdateOptions{})
	if err != nil {
		return nil, fmt.Errorf("set initial node status: %w", err)
	}
	logger.Info("Registered node", "node", n.nodeName)
	return updated, nil
}

func machineStatus(nodeName string) v1.NodeStatus {
	var si unix.Sysinfo_t
	memBytes := int64(0)
	if unix.Sysinfo(&si) == nil {
		memBytes = int64(si.Totalram) * int64(si.Unit)
	}
	var uts unix.Utsname
	kernel := ""
	if unix.Uname(&uts) == nil {
		kernel = unix.ByteSliceToString(uts.Release[:])
	}
	machineID := readTrim("/etc/machine-id")
	bootID := readTrim("/proc/sys/kernel/random/boot_id")
	capacity := v1.ResourceList{
		v1.ResourceCPU:              *resource.NewQuantity(int64(runtime.NumCPU()), resource.DecimalSI),
		v1.ResourceMemory:           *resource.NewQuantity(memBytes, resource.BinarySI),
		v1.ResourcePods:             *resource.NewQuantity(110, resource.DecimalSI),
		v1.ResourceEphemeralStorage: resource.MustParse("100Gi"),
	}
	now := metav1.Now()
	cond := func(t v1.NodeConditionType, s v1.ConditionStatus, reason, msg string) v1.NodeCondition {
		return v1.NodeCondition{Type: t, Status: s, Reason: reason, Message: msg, LastHeartbeatTime: now, LastTransitionTime: now}
	}
	return v1.NodeStatus{
		Capacity:    capacity,
		Allocatable: capacity.DeepCopy(),
		Conditions: []v1.NodeCondition{
			cond(v1.NodeMemoryPressure, v1.ConditionFalse, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
			cond(v1.NodeDiskPressure, v1.ConditionFalse, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
			cond(v1.NodePIDPressure, v1.ConditionFalse, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
			cond(v1.NodeReady, v1.ConditionTrue, "KubeletReady", "kubelet is posting ready status (gpu-sharing kubelet harness)"),
		},
		Addresses: []v1.NodeAddress{
			{Type: v1.NodeInternalIP, Address: "127.0.0.1"},
			{Type: v1.NodeHostName, Address: nodeName},
		},
		NodeInfo: v1.NodeSystemInfo{
			MachineID:               machineID,
			SystemUUID:              machineID,
			BootID:                  bootID,
			KernelVersion:           kernel,
			OSImage:                 osImage(),
			ContainerRuntimeVersion: "harness://0.0.0",
			KubeletVersion:          kubeletVersion,
			OperatingSystem:         runtime.GOOS,
			Architecture:            runtime.GOARCH,
		},
		DaemonEndpoints: v1.NodeDaemonEndpoints{KubeletEndpoint: v1.DaemonEndpoint{Port: 10250}},
	}
}

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func osImage() string {
	b, err := os.ReadFile("/etc/os-release")
	if err != nil {
		return "Linux"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "PRETTY_NAME="); ok {
			return strings.Trim(v, `"`)
		}
	}
	return "Linux"
}
