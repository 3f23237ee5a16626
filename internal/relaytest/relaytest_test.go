package relaytest

import (
	"fmt"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// fatalRecorder is a testing.TB whose Fatalf records the message and ends
// the calling goroutine, as the real one does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}

func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func TestEventuallyReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	took := Eventually(t, 5*time.Second, "the third call", func() bool { return calls.Add(1) == 3 })
	if calls.Load() != 3 {
		t.Fatalf("cond called %d times, want 3", calls.Load())
	}
	if took < 2*pollEvery {
		t.Errorf("took %v for three calls polled every %v", took, pollEvery)
	}
}

func TestEventuallyFailsNamingWhatItWaitedFor(t *testing.T) {
	rec := &fatalRecorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Eventually(rec, 60*time.Millisecond, "the answer", func() bool { return false })
	}()
	<-done
	if !strings.Contains(rec.msg, "the answer") || !strings.Contains(rec.msg, "60ms") {
		t.Fatalf("failure message %q does not name what was waited for and how long", rec.msg)
	}
}

func TestMetricSumsMatchingSeries(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "x_total"}, []string{"class"})
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "y"})
	reg.MustRegister(c, g)
	c.WithLabelValues("a").Add(2)
	c.WithLabelValues("b").Add(3)
	g.Set(7)
	for _, tc := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"x_total", nil, 5},
		{"x_total", map[string]string{"class": "b"}, 3},
		{"x_total", map[string]string{"class": "c"}, 0},
		{"y", nil, 7},
		{"absent", nil, 0},
	} {
		if got := Metric(t, reg, tc.name, tc.labels); got != tc.want {
			t.Errorf("Metric(%s, %v) = %v, want %v", tc.name, tc.labels, got, tc.want)
		}
	}
}

// TestOnlyTestsImportIt: relaytest starts servers and relays; production
// code must not depend on it.
func TestOnlyTestsImportIt(t *testing.T) {
	const self = "github.com/walbox/walbox/internal/relaytest"
	root := filepath.Join("..", "..")
	fset := token.NewFileSet()
	checked := 0
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if name := d.Name(); path != root && (strings.HasPrefix(name, ".") || name == "testdata") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		checked++
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); p == self {
				t.Errorf("%s imports %s: only tests may", path, self)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 50 {
		t.Fatalf("looked at only %d non-test files: wrong root?", checked)
	}
}
