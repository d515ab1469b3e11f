package main

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	criutil "k8s.io/cri-client/pkg/util"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	podresourcesv1alpha1 "k8s.io/kubelet/pkg/apis/podresources/v1alpha1"
	apisgrpc "k8s.io/kubernetes/pkg/kubelet/apis/grpc"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

// The PodResources server is the kubelet's own (podresources.NewV1PodResourcesServer
// behind the kubelet's rate limiter, on a socket made by the kubelet's
// listener helper), the same wiring as pkg/kubelet/server.ListenAndServePodResources,
// which we cannot call directly because it os.Exit()s on errors and drags in the
// whole kubelet HTTP server. Only the providers are ours: devices come from the
// device manager, pods from the harness's active pods list, and there are no
// CPU, memory or DRA managers (empty answers, as with the "none" policies).

// devicesProvider adapts the (current) device manager. The conversion is the
// one in pkg/kubelet/cm (containerDevicesFromResourceDeviceInstances, which
// is unexported): one ContainerDevices entry per device and NUMA node.
type devicesProvider struct{ k *fakeKubelet }

func (p devicesProvider) UpdateAllocatedDevices(logger klog.Logger) {
	p.k.manager().UpdateAllocatedDevices(logger)
}

func (p devicesProvider) GetDevices(podUID, containerName string) []*podresourcesv1.ContainerDevices {
	return containerDevices(p.k.manager().GetDevices(podUID, containerName))
}

func (p devicesProvider) GetAllocatableDevices(logger klog.Logger) []*podresourcesv1.ContainerDevices {
	return containerDevices(p.k.manager().GetAllocatableDevices(logger))
}

func containerDevices(devs devicemanager.ResourceDeviceInstances) []*podresourcesv1.ContainerDevices {
	var out []*podresourcesv1.ContainerDevices
	for resourceName, resourceDevs := range devs {
		for devID, dev := range resourceDevs {
			topo := dev.GetTopology()
			if topo == nil {
				out = append(out, &podresourcesv1.ContainerDevices{ResourceName: resourceName, DeviceIds: []string{devID}})
				continue
			}
			for _, node := range topo.GetNodes() {
				out = append(out, &podresourcesv1.ContainerDevices{
					ResourceName: resourceName,
					DeviceIds:    []string{devID},
					Topology:     &podresourcesv1.TopologyInfo{Nodes: []*podresourcesv1.NUMANode{{ID: node.GetID()}}},
				})
			}
		}
	}
	return out
}

// podsProvider is the kubelet's pod manager as PodResources sees it: none of
// the pods from before a restart while the harness plays a kubelet that has
// not learned them yet.
type podsProvider struct{ k *fakeKubelet }

func (p podsProvider) pods() []*v1.Pod {
	active := p.k.activePods()
	if !p.k.unlearned.Load() {
		return active
	}
	known := make([]*v1.Pod, 0, len(active))
	for _, pod := range active {
		if _, before := p.k.unlearnedPods.Load(pod.UID); !before {
			known = append(known, pod)
		}
	}
	return known
}

func (p podsProvider) GetActivePods() []*v1.Pod { return p.pods() }
func (p podsProvider) GetPods() []*v1.Pod       { return p.pods() }
func (p podsProvider) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, pod := range p.pods() {
		if pod.Namespace == namespace && pod.Name == name {
			return pod, true
		}
	}
	return nil, false
}

type noCPUs struct{}

func (noCPUs) GetCPUs(*v1.Pod, *v1.Container) []int64 { return nil }
func (noCPUs) GetPodCPUs(string) []int64              { return nil }
func (noCPUs) GetAllocatableCPUs() []int64            { return nil }

type noMemory struct{}

func (noMemory) GetMemory(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesv1.ContainerMemory {
	return nil
}
func (noMemory) GetPodMemory(klog.Logger, string) []*podresourcesv1.ContainerMemory { return nil }
func (noMemory) GetAllocatableMemory(klog.Logger) []*podresourcesv1.ContainerMemory { return nil }

type noDRA struct{}

func (noDRA) GetDynamicResources(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesv1.DynamicResource {
	return nil
}

// servePodResources listens on socket and serves PodResources v1 and v1alpha1
// until ctx ends.
func servePodResources(ctx context.Context, socket string, k *fakeKubelet) error {
	providers := podresources.PodResourcesProviders{
		Pods:             podsProvider{k},
		Devices:          devicesProvider{k},
		Cpus:             noCPUs{},
		Memory:           noMemory{},
		DynamicResources: noDRA{},
	}
	server := grpc.NewServer(apisgrpc.WithRateLimiter(ctx, "podresources", podresources.DefaultQPS, podresources.DefaultBurstTokens))
	podresourcesv1alpha1.RegisterPodResourcesListerServer(server, podresources.NewV1alpha1PodResourcesServer(providers))
	podresourcesv1.RegisterPodResourcesListerServer(server, podresources.NewV1PodResourcesServer(ctx, providers))

	l, err := criutil.CreateListener(socket)
	if err != nil {
		return fmt.Errorf("listen on PodResources socket %s: %w", socket, err)
	}
	klog.FromContext(ctx).Info("Serving the PodResources API", "socket", socket)
	go func() {
		<-ctx.Done()
		server.Stop()
	}()
	return server.Serve(l)
}
