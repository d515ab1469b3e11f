// Command dra-kubelet is the kubelet's side of a DRA driver, made of the kubelet's own code
// (k8s.io/kubernetes pkg/kubelet/pluginmanager and pkg/kubelet/cm/dra/plugin at the go.mod
// version), for tests of a DRA kubelet plugin without a whole node.
//
// It watches --registry-dir as the kubelet's plugin watcher watches plugins_registry, so a plugin
// is found, asked GetInfo, validated and told NotifyRegistrationStatus exactly as a kubelet does
// it; then it waits until --driver is registered with the kubelet's DRA plugin manager and the
// plugin has been told so (a kubelet keeps running after it registers a plugin: this one must not
// exit between the two, pkg/kubelet/pluginmanager/operationexecutor GenerateRegisterPluginFunc
// notifies after RegisterPlugin returns) and, through
// that manager's gRPC client, calls NodePrepareResources with every --prepare claim, then
// NodeUnprepareResources with every --unprepare claim (each "namespace/name/uid"), and with
// --health reads the first NodeWatchResources message. It prints one JSON object and exits:
//
//	{"registered": true, "prepare": <NodePrepareResourcesResponse>, "unprepare": <...>, "health": <...>}
//
// Each run is a fresh kubelet, so running it again is what a kubelet restart looks like to the
// plugin. The DRA plugin manager deletes the node's ResourceSlices when it starts, as the kubelet
// does (KEP-4381), so --kubeconfig needs that right.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/operationexecutor"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/pluginwatcher"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/reconciler"
)

type claims []*drapb.Claim

func (c *claims) String() string { return fmt.Sprint(*c) }

func (c *claims) Set(value string) error {
	parts := strings.Split(value, "/")
	if len(parts) != 3 {
		return fmt.Errorf("%q: want namespace/name/uid", value)
	}
	*c = append(*c, &drapb.Claim{Namespace: parts[0], Name: parts[1], Uid: parts[2]})
	return nil
}

// notified: the driver's registration is done, NotifyRegistrationStatus included (a failed notify
// takes the plugin out of the actual state of the world again).
func notified(asw cache.ActualStateOfWorld, executor operationexecutor.OperationExecutor, driver string) bool {
	pending, ok := executor.(interface{ IsOperationPending(socketPath string) bool })
	if !ok {
		return false
	}
	for _, info := range asw.GetRegisteredPlugins() {
		if info.Name == driver && !pending.IsOperationPending(info.SocketPath) {
			return true
		}
	}
	return false
}

func main() {
	registry := flag.String("registry-dir", "", "the plugin registry directory to watch")
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server")
	node := flag.String("node", "", "the node's name")
	driver := flag.String("driver", "", "the DRA driver to wait for")
	timeout := flag.Duration("timeout", 30*time.Second, "how long to wait for the registration")
	health := flag.Bool("health", false, "read the first NodeWatchResources message")
	var prepare, unprepare claims
	flag.Var(&prepare, "prepare", "a claim to prepare: namespace/name/uid (repeatable)")
	flag.Var(&unprepare, "unprepare", "a claim to unprepare: namespace/name/uid (repeatable)")
	flag.Parse()
	if err := run(*registry, *kubeconfig, *node, *driver, *timeout, *health, prepare, unprepare); err != nil {
		fmt.Fprintln(os.Stderr, "dra-kubelet:", err)
		os.Exit(1)
	}
}

func run(registry, kubeconfig, node, driver string, timeout time.Duration, health bool, prepare, unprepare claims) error {
	config, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(config)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	getNode := func(context.Context) (*v1.Node, error) {
		return &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: node, UID: "dra-kubelet"}}, nil
	}
	manager := plugin.NewDRAPluginManager(ctx, client, getNode, nil, 30*time.Second)
	defer manager.Stop()
	// The kubelet's plugin manager (pluginmanager.NewPluginManager) made of its parts, so that
	// its operation executor tells when the registration, NotifyRegistrationStatus included, is done.
	asw, dsw := cache.NewActualStateOfWorld(), cache.NewDesiredStateOfWorld()
	executor := operationexecutor.NewOperationExecutor(operationexecutor.NewOperationGenerator(record.NewFakeRecorder(100)))
	plugins := reconciler.NewReconciler(executor, time.Second, dsw, asw)
	plugins.AddHandler(registerapi.DRAPlugin, manager)
	stop := make(chan struct{})
	defer close(stop)
	if err := pluginwatcher.NewWatcher(registry, dsw).Start(ctx, stop); err != nil {
		return err
	}
	go plugins.Run(ctx)

	deadline := time.Now().Add(timeout)
	var p *plugin.DRAPlugin
	for {
		if p, err = manager.GetPlugin(driver); err == nil && notified(asw, executor, driver) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not register within %s: %w", driver, timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	out := map[string]any{"registered": true}
	if len(prepare) > 0 {
		answer, err := p.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: prepare})
		if err != nil {
			return fmt.Errorf("NodePrepareResources: %w", err)
		}
		out["prepare"] = answer
	}
	if len(unprepare) > 0 {
		answer, err := p.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: unprepare})
		if err != nil {
			return fmt.Errorf("NodeUnprepareResources: %w", err)
		}
		out["unprepare"] = answer
	}
	if health {
		stream, err := p.NodeWatchResources(ctx)
		if err != nil {
			return fmt.Errorf("NodeWatchResources: %w", err)
		}
		first, err := stream.Recv()
		if err != nil {
			return fmt.Errorf("NodeWatchResources: %w", err)
		}
		out["health"] = first
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}
