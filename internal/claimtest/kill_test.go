package claimtest

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/app"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/relaytest"
	"github.com/walbox/walbox/relay/claim"
)

// relayEnv names the config file with which the test binary, started again
// by a test, runs as the relay (runRelay): a real process to kill -9,
// without building the walbox binary. Not WALBOX_*: the relay refuses
// WALBOX_ variables it does not know.
const relayEnv = "CLAIMTEST_RELAY_CONFIG"

// runRelay runs the relay with the JSON config at path until SIGTERM.
func runRelay(path string) int {
	b, err := os.ReadFile(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var cfg config.Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := app.Run(ctx, cfg, zerolog.New(os.Stderr), app.Options{}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// output is a goroutine-safe log of the relay process.
type output struct {
	mu sync.Mutex
	sb strings.Builder
}

func (o *output) Write(b []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.sb.Write(b)
}

func (o *output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.sb.String()
}

// spawnRelay starts the relay as a process of its own and waits until it
// streams.
func (e *env) spawnRelay() (*exec.Cmd, <-chan struct{}) {
	e.t.Helper()
	b, err := json.Marshal(e.cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	path := filepath.Join(e.t.TempDir(), "walbox.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		e.t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), relayEnv+"="+path)
	out := &output{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	e.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
		if e.t.Failed() {
			e.t.Logf("relay process output:\n%s", out)
		}
	})
	relaytest.Eventually(e.t, 30*time.Second, "the relay process to stream (its slot active)", func() bool {
		select {
		case <-done:
			e.t.Fatalf("the relay process exited at start:\n%s", out)
		default:
		}
		var active bool
		relaytest.WithConn(e.t, e.url, func(ctx context.Context, conn *pgx.Conn) error {
			return conn.QueryRow(ctx, "SELECT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = $1", e.cfg.Postgres.Slot).Scan(&active)
		})
		return active
	})
	return cmd, done
}

// TestRelayKilledMidUploadDeliversOnceAndLeavesNoOrphan: kill -9 of the
// relay while a 32 MiB payload is being uploaded; the next relay delivers
// every event once, in order, the payload byte for byte, and after the
// retention sweep the bucket holds no chunk that no object names.
func TestRelayKilledMidUploadDeliversOnceAndLeavesNoOrphan(t *testing.T) {
	e := newEnv(t)
	cmd, done := e.spawnRelay()
	e.insert(100)
	e.insert(32 * MiB)
	e.insert(100)

	// Kill as soon as the bucket's stream has its first chunks.
	relaytest.Eventually(t, 60*time.Second, "the upload to start", func() bool {
		st, err := e.js.Stream(e.ctx, "OBJ_USERS_CLAIMS")
		return err == nil && st.CachedInfo().State.Msgs > 0
	})
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	<-done
	obs, err := e.js.ObjectStore(e.ctx, "USERS_CLAIMS")
	if err != nil {
		t.Fatal(err)
	}
	objs, _ := obs.List(e.ctx)
	st, err := e.js.Stream(e.ctx, "OBJ_USERS_CLAIMS")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("killed with %d chunk and meta messages in the bucket, %d objects complete", st.CachedInfo().State.Msgs, len(objs))

	e.insert(100)
	relaytest.StartRelay(t, e.cfg)
	e.stored(60 * time.Second)
	e.wantHandledAsRows()

	// The sweep, with a slack this test can wait out.
	time.Sleep(300 * time.Millisecond)
	store := claim.NewJetStreamStore(e.js, e.cfg.ClaimBucketSpec())
	stats, err := claim.NewSweeper(store, e.js, 200*time.Millisecond, zerolog.Nop(), nil).Sweep(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("sweep: %+v", stats)
	if stats.Objects != 1 || stats.Deleted != 0 {
		t.Fatalf("sweep %+v, want the one large event's object kept", stats)
	}
	info, err := st.Info(e.ctx, jetstream.WithSubjectFilter("$O.USERS_CLAIMS.C.>"))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(info.State.Subjects); n != 1 {
		t.Fatalf("the bucket holds the chunks of %d uploads after the sweep, want only its object's: %v", n, info.State.Subjects)
	}
}
