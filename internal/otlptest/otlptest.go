// Package otlptest is an OTLP/HTTP trace receiver in the test process: it
// takes what an exporter sends to /v1/traces, as a collector would.
package otlptest

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// Receiver keeps every request it accepted. Hold, when set, holds every
// request until it is closed; Refuse makes it answer 400.
type Receiver struct {
	*httptest.Server
	mu       sync.Mutex
	requests []*coltracepb.ExportTraceServiceRequest
	hold     chan struct{}
	refuse   bool
}

// New starts a receiver, closed at the test's end.
func New(t testing.TB) *Receiver {
	t.Helper()
	r := &Receiver{}
	r.Server = httptest.NewServer(http.HandlerFunc(r.serve))
	t.Cleanup(r.Close)
	return r
}

// Hold makes the receiver hold every request until gate is closed.
func (r *Receiver) Hold(gate chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.hold = gate
}

// Refuse makes the receiver answer every request with 400.
func (r *Receiver) Refuse() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refuse = true
}

func (r *Receiver) serve(w http.ResponseWriter, req *http.Request) {
	if req.URL.Path != "/v1/traces" || req.Header.Get("Content-Type") != "application/x-protobuf" {
		http.Error(w, "OTLP/HTTP protobuf traces only", http.StatusNotFound)
		return
	}
	r.mu.Lock()
	hold, refuse := r.hold, r.refuse
	r.mu.Unlock()
	if hold != nil {
		<-hold
	}
	body, err := io.ReadAll(req.Body)
	var msg coltracepb.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(body, &msg)
	}
	if err != nil || refuse {
		http.Error(w, fmt.Sprint("refused: ", err), http.StatusBadRequest)
		return
	}
	r.mu.Lock()
	r.requests = append(r.requests, &msg)
	r.mu.Unlock()
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// Requests is every request accepted, in order.
func (r *Receiver) Requests() []*coltracepb.ExportTraceServiceRequest {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]*coltracepb.ExportTraceServiceRequest(nil), r.requests...)
}

// Spans is every span received, in order.
func (r *Receiver) Spans() []*tracepb.Span {
	var out []*tracepb.Span
	for _, req := range r.Requests() {
		for _, rs := range req.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				out = append(out, ss.Spans...)
			}
		}
	}
	return out
}
