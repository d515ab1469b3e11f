// Command stub-device-plugin is a minimal device plugin for testing the
// kubelet harness (and anything else that speaks the kubelet side of the
// device-plugin API) before, or next to, the real plugins.
//
// It serves the v1beta1 DevicePlugin API on a fresh socket in --plugin-dir,
// registers on <plugin-dir>/kubelet.sock, and registers again (new socket,
// as the upstream sample does) whenever kubelet.sock is re-created. Devices
// come from --devices and, if given, --devices-file, which is re-read when it
// changes (one device per line: "ID" or "ID Unhealthy"); every change is sent
// on ListAndWatch.
//
// Allocate answers, per container: env STUB_VISIBLE_DEVICES=<ids, comma
// separated>, annotation stub.gpu-sharing.invalid/devices=<ids>, and one CDI
// device "<resource>=<id>" per ID; unknown IDs are an error. With
// --preferred, GetPreferredAllocation prefers the highest IDs (sorted), so a
// test can tell that the kubelet asked. With --prestart, PreStartContainer is
// required (and logged). Every call and device change is logged unless --quiet
// (a benchmark peer must not pay for log lines a production plugin does not write).
// SIGUSR1 re-reads --devices-file at once instead of at the next 100 ms poll,
// so a benchmark can time ListAndWatch updates from a known instant.
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	resource  string
	preferred bool
	prestart  bool
	quiet     bool

	mu      sync.Mutex
	devices []*pluginapi.Device
	changed chan struct{} // closed and replaced on every device change
	stopped chan struct{} // closed when the current server stops

	pluginapi.UnimplementedDevicePluginServer
}

func (p *plugin) setDevices(devs []*pluginapi.Device) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.devices = devs
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *plugin) snapshot() ([]*pluginapi.Device, chan struct{}, chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.devices, p.changed, p.stopped
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{PreStartRequired: p.prestart, GetPreferredAllocationAvailable: p.preferred}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s pluginapi.DevicePlugin_ListAndWatchServer) error {
	klog.Info("ListAndWatch started")
	for {
		devs, changed, stopped := p.snapshot()
		if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: devs}); err != nil {
			return err
		}
		select {
		case <-changed:
		case <-stopped:
			return nil
		case <-s.Context().Done():
			return nil
		}
	}
}

func (p *plugin) GetPreferredAllocation(_ context.Context, r *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	if !p.quiet {
		klog.InfoS("GetPreferredAllocation", "request", r.String())
	}
	resp := &pluginapi.PreferredAllocationResponse{}
	for _, c := range r.ContainerRequests {
		chosen := append([]string{}, c.MustIncludeDeviceIDs...)
		avail := append([]string{}, c.AvailableDeviceIDs...)
		sort.Sort(sort.Reverse(sort.StringSlice(avail)))
		for _, id := range avail {
			if len(chosen) >= int(c.AllocationSize) {
				break
			}
			if !contains(chosen, id) {
				chosen = append(chosen, id)
			}
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: chosen})
	}
	return resp, nil
}

func (p *plugin) Allocate(_ context.Context, r *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	if !p.quiet {
		klog.InfoS("Allocate", "request", r.String())
	}
	devs, _, _ := p.snapshot()
	resp := &pluginapi.AllocateResponse{}
	for _, c := range r.ContainerRequests {
		cr := &pluginapi.ContainerAllocateResponse{
			Envs:        map[string]string{"STUB_VISIBLE_DEVICES": strings.Join(c.DevicesIds, ",")},
			Annotations: map[string]string{"stub.gpu-sharing.invalid/devices": strings.Join(c.DevicesIds, ",")},
		}
		for _, id := range c.DevicesIds {
			if !hasDevice(devs, id) {
				return nil, fmt.Errorf("unknown device %q", id)
			}
			cr.CdiDevices = append(cr.CdiDevices, &pluginapi.CDIDevice{Name: p.resource + "=" + id})
		}
		resp.ContainerResponses = append(resp.ContainerResponses, cr)
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(_ context.Context, r *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	klog.InfoS("PreStartContainer", "devices", r.DevicesIds)
	return &pluginapi.PreStartContainerResponse{}, nil
}

func contains(l []string, s string) bool {
	for _, x := range l {
		if x == s {
			return true
		}
	}
	return false
}

func hasDevice(devs []*pluginapi.Device, id string) bool {
	for _, d := range devs {
		if d.ID == id {
			return true
		}
	}
	return false
}

func parseDevices(text string, sep func(rune) bool) []*pluginapi.Device {
	var devs []*pluginapi.Device
	for _, item := range strings.FieldsFunc(text, sep) {
		f := strings.Fields(item)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		health := pluginapi.Healthy
		if len(f) > 1 {
			health = f[1]
		}
		devs = append(devs, &pluginapi.Device{ID: f[0], Health: health})
	}
	return devs
}

// serveOnce starts a gRPC server on a fresh socket and registers it with the
// kubelet. It returns a function that stops the server and removes the socket.
func (p *plugin) serveOnce(ctx context.Context, dir string) (func(), string, error) {
	name := fmt.Sprintf("stub-%s-%d.sock", strings.NewReplacer("/", "_", ".", "_").Replace(p.resource), time.Now().UnixNano())
	sock := filepath.Join(dir, name)
	l, err := net.Listen("unix", sock)
	if err != nil {
		return nil, "", err
	}
	stopped := make(chan struct{})
	p.mu.Lock()
	p.stopped = stopped
	p.mu.Unlock()
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(l) }()
	stop := func() {
		close(stopped)
		srv.Stop()
		_ = os.Remove(sock)
	}

	// Register: the kubelet dials back and calls GetDevicePluginOptions
	// before answering, so the server must already be serving.
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		stop()
		return nil, "", err
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(rctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     name,
		ResourceName: p.resource,
		Options:      &pluginapi.DevicePluginOptions{PreStartRequired: p.prestart, GetPreferredAllocationAvailable: p.preferred},
	}, grpc.WaitForReady(true))
	if err != nil {
		stop()
		return nil, "", fmt.Errorf("register %s: %w", p.resource, err)
	}
	klog.InfoS("Registered", "resource", p.resource, "socket", sock)
	return stop, sock, nil
}

// fileID identifies one incarnation of a file: a re-created file may get the
// same inode number, but not the same inode and change time.
type fileID struct {
	ino   uint64
	ctime syscall.Timespec
}

func identity(path string) (fileID, bool) {
	var st syscall.Stat_t
	if syscall.Stat(path, &st) != nil {
		return fileID{}, false
	}
	return fileID{st.Ino, st.Ctim}, true
}

func main() {
	dir := flag.String("plugin-dir", "", "device plugin directory (holds kubelet.sock)")
	resource := flag.String("resource", "example.com/dev", "extended resource name")
	devices := flag.String("devices", "Dev-1,Dev-2", "initial devices, comma separated (\"ID\" or \"ID Unhealthy\")")
	devicesFile := flag.String("devices-file", "", "file with one device per line; re-read on change")
	preferred := flag.Bool("preferred", false, "offer GetPreferredAllocation (prefers the highest IDs)")
	prestart := flag.Bool("prestart", false, "require PreStartContainer")
	quiet := flag.Bool("quiet", false, "do not log each call and device change")
	klog.InitFlags(nil)
	flag.Parse()
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "--plugin-dir is required")
		os.Exit(2)
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer cancel()

	p := &plugin{resource: *resource, preferred: *preferred, prestart: *prestart, quiet: *quiet, changed: make(chan struct{}), stopped: make(chan struct{})}
	p.devices = parseDevices(*devices, func(r rune) bool { return r == ',' })
	lastFile := ""
	readFile := func() {
		if *devicesFile == "" {
			return
		}
		b, err := os.ReadFile(*devicesFile)
		if err != nil || string(b) == lastFile {
			return
		}
		lastFile = string(b)
		p.setDevices(parseDevices(lastFile, func(r rune) bool { return r == '\n' }))
		if !p.quiet {
			klog.InfoS("Devices changed", "devices", strings.Join(strings.Fields(lastFile), " "))
		}
	}
	readFile()

	kubeletSock := filepath.Join(*dir, "kubelet.sock")
	var stop func()
	var registeredOn fileID
	ownSock := ""
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	reread := make(chan os.Signal, 1)
	signal.Notify(reread, syscall.SIGUSR1)
	for {
		// (Re-)register whenever kubelet.sock is a new file or our socket is
		// gone: a kubelet restart deletes our socket and forgets us.
		kubeletID, kubeletUp := identity(kubeletSock)
		_, ownUp := identity(ownSock)
		if kubeletUp && (kubeletID != registeredOn || !ownUp) {
			if stop != nil {
				stop()
				stop = nil
			}
			s, sock, err := p.serveOnce(ctx, *dir)
			if err != nil {
				klog.ErrorS(err, "Registration failed; will retry")
			} else {
				stop, registeredOn, ownSock = s, kubeletID, sock
			}
		}
		readFile()
		select {
		case <-ctx.Done():
			if stop != nil {
				stop()
			}
			return
		case <-tick.C:
		case <-reread:
		}
	}
}
