package main

import (
	"context"
	"encoding/json"
	"fmt"
	"reflect"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/admission"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
)

// fakeKubelet owns the real devicemanager.ManagerImpl and the pieces of
// kubelet state that the manager calls back into (the active pods list and
// the "sources ready" flag). Everything the harness exposes (control API,
// PodResources, Node status) reads through it.
type fakeKubelet struct {
	// admitMu serialises admissions and restarts, like the kubelet's
	// HandlePodAdditions loop, which admits one pod at a time.
	admitMu sync.Mutex

	// mgrMu guards the manager pointer, which POST /restart replaces.
	mgrMu sync.RWMutex
	mgr   *devicemanager.ManagerImpl

	// podsMu guards pods. It is separate from admitMu because the manager
	// calls activePods() from inside Allocate.
	podsMu sync.Mutex
	pods   []*v1.Pod

	// unlearned: the PodResources server names none of the pods it ran
	// before the restart, as a starting kubelet's does until its sync loop
	// has received them from the API server (POST /restart?learn=later sets
	// it, POST /learn clears it). A pod admitted since is named: a kubelet
	// admits only a pod its pod manager has learned (kubelet.go,
	// HandlePodAdditions adds the pod to the pod manager, then admits it).
	unlearned atomic.Bool
	// unlearnedPods: the UIDs of the pods running at that restart.
	unlearnedPods sync.Map

	state *resourceState
	// sampleMu serialises samples: GetCapacity reports a removed resource
	// only once, so two concurrent samples must not interleave.
	sampleMu sync.Mutex
}

// sourcesReady tells the manager that all pod sources are synced, as they
// are shortly after a kubelet start. With AllReady false, the manager would
// never garbage-collect devices of deleted pods (UpdateAllocatedDevices).
type sourcesReady struct{}

func (sourcesReady) AddSource(string) {}
func (sourcesReady) AllReady() bool   { return true }

func newFakeKubelet() *fakeKubelet {
	return &fakeKubelet{state: newResourceState()}
}

func (k *fakeKubelet) manager() *devicemanager.ManagerImpl {
	k.mgrMu.RLock()
	defer k.mgrMu.RUnlock()
	return k.mgr
}

// activePods is the devicemanager.ActivePodsFunc: pods admitted and not
// deleted. The manager frees devices of pods missing from this list.
func (k *fakeKubelet) activePods() []*v1.Pod {
	k.podsMu.Lock()
	defer k.podsMu.Unlock()
	return append([]*v1.Pod(nil), k.pods...)
}

// startManager creates a fresh ManagerImpl exactly as the kubelet's
// container manager does (no NUMA topology, a topology manager that has no
// opinion) and starts it. Start reads the checkpoint, deletes every socket
// in the plugin directory and listens on a new kubelet.sock.
func (k *fakeKubelet) startManager(logger klog.Logger) error {
	mgr, err := devicemanager.NewManagerImpl(logger, nil, topologymanager.NewFakeManager(logger))
	if err != nil {
		return fmt.Errorf("create device manager: %w", err)
	}
	// After a kubelet restart the container runtime reports the containers
	// that are still running; the manager uses that to avoid re-allocating
	// their devices. Our "containers" are the active pods' containers.
	containers := containermap.NewContainerMap()
	running := sets.New[string]()
	for _, pod := range k.activePods() {
		for _, c := range append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
			id := fmt.Sprintf("harness://%s/%s", pod.UID, c.Name)
			containers.Add(string(pod.UID), c.Name, id)
			running.Insert(id)
		}
	}
	if err := mgr.Start(logger, k.activePods, sourcesReady{}, containers, running); err != nil {
		return fmt.Errorf("start device manager: %w", err)
	}
	k.mgrMu.Lock()
	k.mgr = mgr
	k.mgrMu.Unlock()
	return nil
}

// restart simulates a kubelet restart: the old manager stops (its
// registration server closes, plugin connections are dropped), then a new
// one starts from the checkpoint. Active pods are kept, as running
// containers survive a kubelet restart. With unlearned, PodResources lists no
// pod until learn(): the kubelet serves PodResources beside its sync loop
// (cmd/kubelet/app/server.go, startKubelet), and its pod manager learns the
// pods only as that loop receives them (pkg/kubelet/kubelet.go, syncLoop ->
// HandlePodAdditions), so a real kubelet's List is short for a while after a
// start, longer when the API server is out of reach.
func (k *fakeKubelet) restart(logger klog.Logger, unlearned bool) error {
	k.admitMu.Lock()
	defer k.admitMu.Unlock()
	k.unlearnedPods.Clear()
	if unlearned {
		for _, pod := range k.activePods() {
			k.unlearnedPods.Store(pod.UID, true)
		}
	}
	k.unlearned.Store(unlearned)
	if old := k.manager(); old != nil {
		if err := old.Stop(logger); err != nil {
			logger.Error(err, "Stopping old device manager")
		}
	}
	k.state.forgetRemoved()
	if err := k.startManager(logger); err != nil {
		return err
	}
	// Sample right away so that /resources never shows the old manager's
	// state after POST /restart has answered.
	k.sampleResources(logger)
	return nil
}

func (k *fakeKubelet) stop(logger klog.Logger) {
	if m := k.manager(); m != nil {
		if err := m.Stop(logger); err != nil {
			logger.Error(err, "Stopping device manager")
		}
	}
}

// ---- pods -----------------------------------------------------------------

type containerSpec struct {
	Name          string            `json:"name"`
	Limits        map[string]string `json:"limits"`
	RestartPolicy string            `json:"restartPolicy,omitempty"` // init containers only: "Always" = sidecar
}

type podSpec struct {
	Namespace      string          `json:"namespace"`
	Name           string          `json:"name"`
	UID            string          `json:"uid,omitempty"`
	InitContainers []containerSpec `json:"initContainers,omitempty"`
	Containers     []containerSpec `json:"containers"`
}

type containerResult struct {
	Name        string              `json:"name"`
	Devices     map[string][]string `json:"devices"`
	Envs        map[string]string   `json:"envs"`
	Annotations map[string]string   `json:"annotations"`
	CDIDevices  []string            `json:"cdiDevices"`
	Mounts      []map[string]any    `json:"mounts"`
	DeviceNodes []map[string]string `json:"deviceNodes"`
}

type podResult struct {
	Namespace  string            `json:"namespace"`
	Name       string            `json:"name"`
	UID        string            `json:"uid"`
	Containers []containerResult `json:"containers"`
}

// admissionError carries the kubelet's admission result for a rejected pod.
type admissionError struct {
	Message string `json:"error"`
	Reason  string `json:"reason"`
	Stage   string `json:"stage"` // "admit" (pod rejected) or "start" (container start failed)
}

func (e *admissionError) Error() string { return e.Message }

func buildContainer(s containerSpec) (v1.Container, error) {
	if s.Name == "" {
		return v1.Container{}, fmt.Errorf("container without a name")
	}
	c := v1.Container{Name: s.Name, Image: "harness.invalid/none"}
	if len(s.Limits) > 0 {
		rl := v1.ResourceList{}
		for name, q := range s.Limits {
			qty, err := resource.ParseQuantity(q)
			if err != nil {
				return c, fmt.Errorf("container %q: limit %s=%q: %w", s.Name, name, q, err)
			}
			rl[v1.ResourceName(name)] = qty
		}
		// Extended resources cannot be overcommitted: requests == limits.
		c.Resources = v1.ResourceRequirements{Limits: rl, Requests: rl.DeepCopy()}
	}
	if s.RestartPolicy != "" {
		p := v1.ContainerRestartPolicy(s.RestartPolicy)
		c.RestartPolicy = &p
	}
	return c, nil
}

func buildPod(s podSpec) (*v1.Pod, error) {
	if s.Name == "" {
		return nil, fmt.Errorf("pod needs a name")
	}
	if s.Namespace == "" {
		s.Namespace = "default"
	}
	uid := types.UID(s.UID)
	if uid == "" {
		uid = uuid.NewUUID()
	}
	pod := &v1.Pod{
		TypeMeta:   metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name, UID: uid, CreationTimestamp: metav1.Now()},
		Status:     v1.PodStatus{Phase: v1.PodRunning},
	}
	for _, cs := range s.InitContainers {
		c, err := buildContainer(cs)
		if err != nil {
			return nil, err
		}
		pod.Spec.InitContainers = append(pod.Spec.InitContainers, c)
	}
	for _, cs := range s.Containers {
		c, err := buildContainer(cs)
		if err != nil {
			return nil, err
		}
		pod.Spec.Containers = append(pod.Spec.Containers, c)
	}
	if len(pod.Spec.Containers) == 0 {
		return nil, fmt.Errorf("pod needs at least one container")
	}
	return pod, nil
}

// admit does what the kubelet does for a new pod, in the same order:
//  1. the pod joins the pod manager (so it is "active" while it is admitted;
//     the manager's garbage collection would otherwise free the devices of
//     its first container while allocating the second);
//  2. the topology manager's admit handler calls the device manager's
//     Allocate for every init container, then every app container
//     (this drives GetPreferredAllocation and Allocate on the plugin);
//     a failure rejects the pod with the kubelet's UnexpectedAdmissionError;
//  3. before each container starts, GetDeviceRunContainerOptions (which
//     calls PreStartContainer when the plugin asks for it) yields the envs,
//     mounts, device nodes, annotations and CDI devices for the runtime.
func (k *fakeKubelet) admit(ctx context.Context, spec podSpec) (*podResult, error) {
	pod, err := buildPod(spec)
	if err != nil {
		return nil, err
	}
	k.admitMu.Lock()
	defer k.admitMu.Unlock()
	mgr := k.manager()

	k.podsMu.Lock()
	for _, p := range k.pods {
		if p.Namespace == pod.Namespace && p.Name == pod.Name {
			k.podsMu.Unlock()
			return nil, &admissionError{Message: fmt.Sprintf("pod %s/%s already exists", pod.Namespace, pod.Name), Reason: "AlreadyExists", Stage: "admit"}
		}
	}
	k.pods = append(k.pods, pod)
	k.podsMu.Unlock()

	all := append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...)
	for i := range all {
		if err := mgr.Allocate(ctx, pod, &all[i], lifecycle.AddOperation); err != nil {
			k.removePod(pod.UID) // a rejected pod is never active
			res := admission.GetPodAdmitResult(err)
			return nil, &admissionError{Message: res.Message, Reason: res.Reason, Stage: "admit"}
		}
	}

	result := &podResult{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID)}
	for i := range all {
		opts, err := mgr.GetDeviceRunContainerOptions(ctx, pod, &all[i])
		if err != nil {
			// In the kubelet the pod stays admitted and the container fails
			// to start; keep it active so its devices stay allocated.
			return nil, &admissionError{Message: err.Error(), Reason: "RunContainerError", Stage: "start"}
		}
		result.Containers = append(result.Containers, containerInfo(mgr, pod, all[i].Name, opts))
	}
	return result, nil
}

func containerInfo(mgr *devicemanager.ManagerImpl, pod *v1.Pod, name string, opts *devicemanager.DeviceRunContainerOptions) containerResult {
	r := containerResult{
		Name:        name,
		Devices:     deviceIDs(mgr.GetDevices(string(pod.UID), name)),
		Envs:        map[string]string{},
		Annotations: map[string]string{},
		CDIDevices:  []string{},
		Mounts:      []map[string]any{},
		DeviceNodes: []map[string]string{},
	}
	if opts == nil { // no device-plugin resources in this container
		return r
	}
	for _, e := range opts.Envs {
		r.Envs[e.Name] = e.Value
	}
	for _, a := range opts.Annotations {
		r.Annotations[a.Name] = a.Value
	}
	for _, c := range opts.CDIDevices {
		r.CDIDevices = append(r.CDIDevices, c.Name)
	}
	for _, m := range opts.Mounts {
		r.Mounts = append(r.Mounts, map[string]any{"containerPath": m.ContainerPath, "hostPath": m.HostPath, "readOnly": m.ReadOnly})
	}
	for _, d := range opts.Devices {
		r.DeviceNodes = append(r.DeviceNodes, map[string]string{"hostPath": d.PathOnHost, "containerPath": d.PathInContainer, "permissions": d.Permissions})
	}
	return r
}

func deviceIDs(devs devicemanager.ResourceDeviceInstances) map[string][]string {
	out := map[string][]string{}
	for res, ids := range devs {
		l := make([]string, 0, len(ids))
		for id := range ids {
			l = append(l, id)
		}
		sort.Strings(l)
		out[res] = l
	}
	return out
}

func (k *fakeKubelet) removePod(uid types.UID) bool {
	k.podsMu.Lock()
	defer k.podsMu.Unlock()
	for i, p := range k.pods {
		if p.UID == uid {
			k.pods = append(k.pods[:i], k.pods[i+1:]...)
			return true
		}
	}
	return false
}

// deletePod removes a pod (by namespace/name, or by UID when name is empty)
// from the active list. As in the kubelet, its devices are freed the next
// time the manager garbage-collects (next Allocate or PodResources List).
func (k *fakeKubelet) deletePod(namespace, name string) bool {
	k.podsMu.Lock()
	defer k.podsMu.Unlock()
	for i, p := range k.pods {
		if (name == "" && string(p.UID) == namespace) || (p.Namespace == namespace && p.Name == name) {
			k.pods = append(k.pods[:i], k.pods[i+1:]...)
			return true
		}
	}
	return false
}

func (k *fakeKubelet) listPods() []podResult {
	mgr := k.manager()
	var out []podResult
	for _, pod := range k.activePods() {
		r := podResult{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID), Containers: []containerResult{}}
		for _, c := range append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
			r.Containers = append(r.Containers, containerResult{Name: c.Name, Devices: deviceIDs(mgr.GetDevices(string(pod.UID), c.Name))})
		}
		out = append(out, r)
	}
	return out
}

// ---- resource snapshot ----------------------------------------------------

// resourceInfo is one resource as the kubelet would report it.
type resourceInfo struct {
	Capacity    int64    `json:"capacity"`
	Allocatable int64    `json:"allocatable"`
	Healthy     []string `json:"healthy"`
	// Removed: the endpoint was stopped for longer than the grace period and
	// GetCapacity dropped the resource; the kubelet keeps it in the Node
	// status with capacity 0.
	Removed bool `json:"removed,omitempty"`
}

// resourceState is the last observed GetCapacity/GetAllocatableDevices
// answer, with a generation that increases on every change and a channel
// closed on every change (for long-polling clients).
type resourceState struct {
	mu         sync.Mutex
	generation int64
	resources  map[string]resourceInfo
	changed    chan struct{}
	// removed remembers resources GetCapacity reported as deleted: it
	// reports them only once, while the kubelet's Node status keeps an
	// explicit 0 for them until they come back.
	removed sets.Set[string]
}

func newResourceState() *resourceState {
	return &resourceState{resources: map[string]resourceInfo{}, changed: make(chan struct{}), removed: sets.New[string]()}
}

func (s *resourceState) forgetRemoved() {
	s.mu.Lock()
	defer s.mu.Unlock()
	// A restarted kubelet starts with a fresh device manager; its removed
	// list is whatever the new manager reports. The Node status keeps the
	// zeros anyway (the syncer never deletes keys).
	s.removed = sets.New[string]()
}

// update records a new observation and reports whether it changed anything.
func (s *resourceState) update(capacity, allocatable v1.ResourceList, removed []string, healthy devicemanager.ResourceDeviceInstances) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.removed.Insert(removed...)
	next := map[string]resourceInfo{}
	for name, q := range capacity {
		s.removed.Delete(string(name))
		a := allocatable[name]
		ids := deviceIDs(healthy)[string(name)]
		if ids == nil {
			ids = []string{}
		}
		next[string(name)] = resourceInfo{Capacity: q.Value(), Allocatable: a.Value(), Healthy: ids}
	}
	for name := range s.removed {
		next[name] = resourceInfo{Healthy: []string{}, Removed: true}
	}
	if reflect.DeepEqual(next, s.resources) {
		return false
	}
	s.resources = next
	s.generation++
	close(s.changed)
	s.changed = make(chan struct{})
	return true
}

type resourcesReply struct {
	Resources  map[string]resourceInfo `json:"resources"`
	Generation int64                   `json:"generation"`
}

func (s *resourceState) snapshot() (resourcesReply, chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// The maps are replaced, never mutated, so sharing them is safe.
	return resourcesReply{Resources: s.resources, Generation: s.generation}, s.changed
}

// wait returns the state once its generation is above after, or the current
// state when ctx ends.
func (s *resourceState) wait(ctx context.Context, after int64) resourcesReply {
	for {
		snap, changed := s.snapshot()
		if snap.Generation > after {
			return snap
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return snap
		}
	}
}

// sampleResources reads the manager the way the kubelet's node status loop
// does (GetCapacity), plus GetAllocatableDevices, into k.state.
func (k *fakeKubelet) sampleResources(logger klog.Logger) {
	k.sampleMu.Lock()
	defer k.sampleMu.Unlock()
	mgr := k.manager()
	if mgr == nil {
		return
	}
	capacity, allocatable, removed := mgr.GetCapacity(logger)
	if k.state.update(capacity, allocatable, removed, mgr.GetAllocatableDevices(logger)) {
		snap, _ := k.state.snapshot()
		b, _ := json.Marshal(snap)
		logger.V(1).Info("Device resources changed", "state", string(b))
	}
}

// pollResources samples the manager every interval.
func (k *fakeKubelet) pollResources(ctx context.Context, logger klog.Logger, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		k.sampleResources(logger)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
