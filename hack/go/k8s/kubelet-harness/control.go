package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	criutil "k8s.io/cri-client/pkg/util"
	"k8s.io/klog/v2"
)

// The control API is plain HTTP/1.1 + JSON on a unix socket, so tests in
// any language can drive the harness with a few lines (Python: http.client
// over an AF_UNIX socket). See README in main.go for the endpoints.

type controlServer struct {
	k       *fakeKubelet
	logger  klog.Logger
	started atomic.Bool // the device manager is up: /healthz says ok
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, code int, err error) {
	writeJSON(w, code, map[string]string{"error": err.Error()})
}

func (s *controlServer) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", s.healthz)
	mux.HandleFunc("GET /resources", s.resources)
	mux.HandleFunc("GET /pods", s.listPods)
	mux.HandleFunc("POST /pods", s.admitPod)
	mux.HandleFunc("DELETE /pods/{uid}", s.deletePod)
	mux.HandleFunc("DELETE /pods/{namespace}/{name}", s.deletePod)
	mux.HandleFunc("POST /restart", s.restart)
	mux.HandleFunc("POST /learn", s.learn)
	return mux
}

func (s *controlServer) healthz(w http.ResponseWriter, r *http.Request) {
	if !s.started.Load() {
		writeError(w, http.StatusServiceUnavailable, errors.New("device manager not started"))
		return
	}
	if mgr := s.k.manager(); mgr != nil {
		if err := mgr.GetHealthChecker().Check(r); err != nil {
			writeError(w, http.StatusServiceUnavailable, err)
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// parseTimeout accepts a Go duration ("5s", "250ms") or plain seconds ("5", "0.5").
func parseTimeout(v string) (time.Duration, error) {
	if d, err := time.ParseDuration(v); err == nil {
		return d, nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil {
		return 0, fmt.Errorf("bad timeout %q", v)
	}
	return time.Duration(f * float64(time.Second)), nil
}

// GET /resources[?after=G&timeout=5s]: the current state; with after, wait
// (at most timeout, default 30s, max 5m) until the generation is above G.
func (s *controlServer) resources(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	if q.Get("after") == "" {
		snap, _ := s.k.state.snapshot()
		writeJSON(w, http.StatusOK, snap)
		return
	}
	after, err := strconv.ParseInt(q.Get("after"), 10, 64)
	if err != nil {
		writeError(w, http.StatusBadRequest, fmt.Errorf("bad after: %w", err))
		return
	}
	timeout := 30 * time.Second
	if t := q.Get("timeout"); t != "" {
		if timeout, err = parseTimeout(t); err != nil {
			writeError(w, http.StatusBadRequest, err)
			return
		}
	}
	timeout = min(timeout, 5*time.Minute)
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	writeJSON(w, http.StatusOK, s.k.state.wait(ctx, after))
}

func (s *controlServer) listPods(w http.ResponseWriter, r *http.Request) {
	pods := s.k.listPods()
	if pods == nil {
		pods = []podResult{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"pods": pods})
}

func (s *controlServer) admitPod(w http.ResponseWriter, r *http.Request) {
	var spec podSpec
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&spec); err != nil {
		writeError(w, http.StatusBadRequest, fmt.Errorf("bad pod: %w", err))
		return
	}
	res, err := s.k.admit(r.Context(), spec)
	var admitErr *admissionError
	switch {
	case errors.As(err, &admitErr):
		s.logger.Info("Pod not admitted", "pod", spec.Namespace+"/"+spec.Name, "reason", admitErr.Reason, "stage", admitErr.Stage, "err", admitErr.Message)
		writeJSON(w, http.StatusConflict, admitErr)
	case err != nil:
		writeError(w, http.StatusBadRequest, err)
	default:
		s.logger.Info("Pod admitted", "pod", res.Namespace+"/"+res.Name, "uid", res.UID)
		writeJSON(w, http.StatusOK, res)
	}
}

func (s *controlServer) deletePod(w http.ResponseWriter, r *http.Request) {
	var ok bool
	if uid := r.PathValue("uid"); uid != "" {
		ok = s.k.deletePod(uid, "")
	} else {
		ok = s.k.deletePod(r.PathValue("namespace"), r.PathValue("name"))
	}
	if !ok {
		writeError(w, http.StatusNotFound, fmt.Errorf("no such pod: %s", strings.TrimPrefix(r.URL.Path, "/pods/")))
		return
	}
	writeJSON(w, http.StatusOK, map[string]bool{"deleted": true})
}

func (s *controlServer) restart(w http.ResponseWriter, r *http.Request) {
	learn := r.URL.Query().Get("learn")
	if learn != "" && learn != "later" {
		writeError(w, http.StatusBadRequest, fmt.Errorf("bad learn %q: only \"later\" is known", learn))
		return
	}
	s.logger.Info("Simulating a kubelet restart", "podsLearnedLater", learn == "later")
	s.started.Store(false)
	if err := s.k.restart(s.logger, learn == "later"); err != nil {
		writeError(w, http.StatusInternalServerError, err)
		return
	}
	s.started.Store(true)
	writeJSON(w, http.StatusOK, map[string]bool{"restarted": true})
}

// learn ends the short List of a restart with learn=later: the kubelet has
// received its pods from the API server.
func (s *controlServer) learn(w http.ResponseWriter, r *http.Request) {
	s.logger.Info("The kubelet has learned its pods")
	s.k.unlearned.Store(false)
	writeJSON(w, http.StatusOK, map[string]bool{"learned": true})
}

// serve listens on the control socket until ctx ends.
func (s *controlServer) serve(ctx context.Context, socket string) error {
	l, err := criutil.CreateListener(socket)
	if err != nil {
		return fmt.Errorf("listen on control socket %s: %w", socket, err)
	}
	srv := &http.Server{Handler: s.routes(), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdownCtx)
	}()
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
