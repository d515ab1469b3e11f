// Command kubelet-harness runs the kubelet's real device manager
// (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager) without the rest of the
// kubelet, so device plugins can be tested against real kubelet code on a
// machine with no container runtime.
//
// What it runs, all from k8s.io/kubernetes:
//   - the device manager (registration server on kubelet.sock, plugin
//     dial-back, ListAndWatch, GetPreferredAllocation, Allocate,
//     PreStartContainer, checkpoint, CleanupPluginDirectory on start);
//   - the PodResources v1/v1alpha1 gRPC server (pkg/kubelet/apis/podresources);
//   - optionally a Node status sync like the kubelet's MachineInfo setter.
//
// It runs in its own mount namespace (see mountns.go): <root>/device-plugins
// on the host appears as /var/lib/kubelet/device-plugins to the kubelet code.
//
// Control API (HTTP/1.1 + JSON on --control, a unix socket):
//
//	GET    /healthz                     200 once the device manager is started
//	GET    /resources[?after=G&timeout=5s]
//	       {"resources": {name: {"capacity", "allocatable", "healthy": [ids], "removed"?}},
//	        "generation": G}; with after, long-polls until generation > G
//	POST   /pods   {"namespace","name","containers":[{"name","limits":{res: "n"}}],
//	                "initContainers"?: [...], "uid"?}
//	       admits the pod like the kubelet: 200 {"uid","containers":[{"name","devices",
//	       "envs","annotations","cdiDevices","mounts","deviceNodes"}]}, or 409
//	       {"error": kubelet's message, "reason", "stage": "admit"|"start"}
//	GET    /pods                        active pods and their devices
//	DELETE /pods/<namespace>/<name>, DELETE /pods/<uid>
//	       the pod stops being active; its devices are freed at the next
//	       allocation or PodResources List, as in the kubelet
//	POST   /restart[?learn=later]       simulated kubelet restart (stop the
//	       manager, start a new one from the checkpoint; pods are kept); with
//	       learn=later, PodResources lists none of the pods from before the
//	       restart until POST /learn, as a starting kubelet's List is short
//	       until it has learned its pods (pods admitted since are listed)
//	POST   /learn                       the restarted kubelet has learned its pods
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"k8s.io/component-base/version"
	"k8s.io/klog/v2"
)

// kubeletVersion is what the Node reports; build-go.sh stamps the
// component-base version like the Kubernetes build does.
var kubeletVersion = func() string {
	v := version.Get().GitVersion
	if v == "" || strings.HasPrefix(v, "v0.0.0") {
		return "v1.37.2-harness"
	}
	return v
}()

type options struct {
	root               string
	control            string
	podResourcesSocket string
	kubeconfig         string
	nodeName           string
	nodeStatusInterval time.Duration
	pollInterval       time.Duration
}

func parseFlags() options {
	var o options
	fs := flag.CommandLine
	fs.StringVar(&o.root, "root", "", "harness state directory (required); plugins put sockets in <root>/device-plugins")
	fs.StringVar(&o.control, "control", "", "unix socket of the control API (default <root>/harness.sock)")
	fs.StringVar(&o.podResourcesSocket, "pod-resources-socket", "", "PodResources socket (default <root>/pod-resources/kubelet.sock)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig for the Node status sync (optional)")
	fs.StringVar(&o.nodeName, "node-name", "", "Node to register and keep in sync (needs --kubeconfig)")
	fs.DurationVar(&o.nodeStatusInterval, "node-status-interval", 500*time.Millisecond, "how often the Node status is checked and patched if it differs")
	fs.DurationVar(&o.pollInterval, "poll-interval", 100*time.Millisecond, "how often GetCapacity/GetAllocatableDevices are sampled for /resources")
	klog.InitFlags(fs)
	_ = fs.Set("v", "2") // the device manager logs registrations at V(2)
	flag.Parse()
	return o
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintf(os.Stderr, "kubelet-harness: %v\n", err)
		os.Exit(1)
	}
}

func run() error {
	o := parseFlags()
	if o.root == "" {
		return fmt.Errorf("--root is required")
	}
	if (o.nodeName == "") != (o.kubeconfig == "") {
		return fmt.Errorf("--node-name and --kubeconfig go together")
	}
	root, err := filepath.Abs(o.root)
	if err != nil {
		return err
	}
	if o.control == "" {
		o.control = filepath.Join(root, "harness.sock")
	}
	if o.podResourcesSocket == "" {
		o.podResourcesSocket = filepath.Join(root, "pod-resources", "kubelet.sock")
	}

	// Step 1 (before any goroutine matters): get into a private mount
	// namespace. This execs; on return we are inside it.
	if err := reexecInMountNamespace(); err != nil {
		return err
	}
	hostPluginDir := filepath.Join(root, "device-plugins")
	if err := os.MkdirAll(hostPluginDir, 0o750); err != nil {
		return err
	}
	if err := setupKubeletDir(hostPluginDir); err != nil {
		return err
	}

	logger := klog.Background()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx = klog.NewContext(ctx, logger)

	k := newFakeKubelet()
	if err := k.startManager(logger); err != nil {
		return err
	}
	defer k.stop(logger)
	logger.Info("Device manager started", "pluginDir", hostPluginDir, "seenAs", kubeletPluginDir, "kubeletVersion", kubeletVersion)

	go k.pollResources(ctx, logger, o.pollInterval)

	errc := make(chan error, 3)
	go func() {
		if err := servePodResources(ctx, o.podResourcesSocket, k); err != nil {
			errc <- err
		}
	}()
	ctl := &controlServer{k: k, logger: logger}
	ctl.started.Store(true)
	go func() {
		if err := ctl.serve(ctx, o.control); err != nil {
			errc <- err
		}
	}()
	if o.nodeName != "" {
		ns, err := newNodeSyncer(o.kubeconfig, o.nodeName, k)
		if err != nil {
			return err
		}
		go ns.run(ctx, logger, o.nodeStatusInterval)
	}
	logger.Info("Kubelet harness ready", "control", o.control, "podResources", o.podResourcesSocket, "node", o.nodeName)

	select {
	case <-ctx.Done():
		logger.Info("Shutting down")
		return nil
	case err := <-errc:
		return err
	}
}
