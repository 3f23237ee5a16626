package main

import (
	"bufio"
	"bytes"
	"context"
	"debug/buildinfo"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"gopkg.in/yaml.v3"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/natstest"
	"github.com/walbox/walbox/internal/pgtest"
	"github.com/walbox/walbox/internal/vcs"
	walboxsql "github.com/walbox/walbox/sql"
)

const (
	dbName      = "walbox_bench"
	slotName    = "walbox"
	ceilingSlot = "bench_ceiling"
	concSlot    = "bench_ceiling_conc"
	// concBatchSlot: the concurrent ceiling with the batched publisher.
	concBatchSlot = "bench_ceiling_concb"
	floorSlot     = "bench_floor"
	publication   = "walbox_outbox"
	benchStream   = "BENCH"
	ceilStream    = "CEIL"
	// ceilBatchStream: the batched publishing ceiling's (allow_batched).
	ceilBatchStream = "CEILB"
	dupWindow       = 2 * time.Minute

	// walboxLDFlags are the Makefile's (and the Dockerfile's) for the walbox
	// binary: the relay is measured as it is built for users
	// (internal/deploytest checks the three agree). The profiled relay runs
	// in this program, built without them: it gets walboxGODEBUG from its
	// environment instead.
	walboxGODEBUG = "schedtrace=2147483647"
	walboxLDFlags = "-ldflags=-X=runtime.godebugDefault=" + walboxGODEBUG
)

// environment is what the phases share.
type environment struct {
	moduleDir string
	tmp       string
	binary    string
	cfgFile   string
	pg        *pgtest.Cluster
	dbURL     string
	pool      *pgxpool.Pool // small pool for control queries
	ns        *natstest.Server
	nc        *nats.Conn
	js        jetstream.JetStream
	metrics   string // the relay's metrics address (host:port)
	info      envInfo
}

// envInfo describes the machine and versions for the report.
type envInfo struct {
	CPUs      int
	CPUModel  string
	MemTotal  string
	Kernel    string
	GoVersion string
	PGVersion string
	NATS      string
	PGSet     string
	Walbox    string // the commit the relay was built from
}

func (b *bench) setup(ctx context.Context) (*environment, error) {
	t0 := time.Now()
	env := &environment{}
	b.logf("setup: building walbox, starting PostgreSQL (wal_level=logical) and nats-server (file store)")
	gobin, err := goTool()
	if err != nil {
		return nil, err
	}
	out, err := exec.CommandContext(ctx, gobin, "env", "GOMOD").Output()
	if err != nil || strings.TrimSpace(string(out)) == "" || strings.TrimSpace(string(out)) == os.DevNull {
		return nil, fmt.Errorf("run from inside the bench module: cd bench && go run . (go env GOMOD: %q, %v)", strings.TrimSpace(string(out)), err)
	}
	// The benchmark is its own module (bench/go.mod), so that its peers and
	// chart library stay out of walbox's go.mod; walbox is its parent.
	env.moduleDir = filepath.Dir(filepath.Dir(strings.TrimSpace(string(out))))
	if _, err := os.Stat(filepath.Join(env.moduleDir, "cmd", "walbox")); err != nil {
		return nil, fmt.Errorf("walbox's cmd/walbox not found next to the bench module in %s: run from a walbox checkout", env.moduleDir)
	}

	env.tmp, err = os.MkdirTemp("", "walbox-bench-")
	if err != nil {
		return nil, err
	}
	b.onCleanup(func() { os.RemoveAll(env.tmp) })
	env.binary = filepath.Join(env.tmp, "walbox")
	bctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	build := exec.CommandContext(bctx, gobin, "build", walboxLDFlags, "-o", env.binary, "./cmd/walbox")
	build.Dir = env.moduleDir
	out, err = build.CombinedOutput()
	cancel()
	if err != nil {
		return nil, fmt.Errorf("go build ./cmd/walbox: %w\n%s", cause(bctx, err), out)
	}

	pctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	var opts []pgtest.Option
	if b.p.Fsync { // as users run PostgreSQL; pgtest's defaults are the fast fsync=off variant
		opts = append(opts, pgtest.WithSetting("fsync", "on"), pgtest.WithSetting("synchronous_commit", "on"),
			pgtest.WithSetting("full_page_writes", "on"))
	}
	env.pg, err = pgtest.Start(pctx, opts...)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("start PostgreSQL: %w", err)
	}
	b.onCleanup(func() {
		if err := env.pg.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "bench: closing PostgreSQL:", err)
		}
	})
	env.dbURL, err = env.pg.CreateDB(ctx, dbName)
	if err != nil {
		return nil, err
	}
	conn, err := pgx.Connect(ctx, env.dbURL)
	if err != nil {
		return nil, err
	}
	_, err = walboxsql.Apply(ctx, conn, walboxsql.Params{Publication: publication})
	if err == nil {
		err = conn.QueryRow(ctx, "SHOW server_version").Scan(&env.info.PGVersion)
	}
	if err == nil {
		var fs, sc, fpw string
		err = conn.QueryRow(ctx, "SELECT current_setting('fsync'), current_setting('synchronous_commit'), current_setting('full_page_writes')").Scan(&fs, &sc, &fpw)
		env.info.PGSet = fmt.Sprintf("fsync=%s, synchronous_commit=%s, full_page_writes=%s", fs, sc, fpw)
	}
	conn.Close(context.Background())
	if err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	env.pool, err = pgxpool.New(ctx, env.dbURL)
	if err != nil {
		return nil, err
	}
	b.onCleanup(env.pool.Close)

	env.ns, err = natstest.Start()
	if err != nil {
		return nil, fmt.Errorf("start nats-server: %w", err)
	}
	b.onCleanup(env.ns.Close)
	env.nc, err = nats.Connect(env.ns.URL(), nats.Name("walbox-bench"))
	if err != nil {
		return nil, err
	}
	b.onCleanup(env.nc.Close)
	env.js, err = jetstream.New(env.nc)
	if err != nil {
		return nil, err
	}

	cfg := config.Default()
	cfg.Postgres.URL = env.dbURL
	cfg.Postgres.Slot = slotName
	cfg.Postgres.Publication = publication
	cfg.NATS.URL = env.ns.URL()
	cfg.NATS.Streams = []config.Stream{{Name: benchStream, Subjects: []string{"bench.>"}, Storage: "file", DuplicateWindow: dupWindow}}
	// The live phases read the relay's split of commit → ack from it.
	if env.metrics, err = freeLocalAddr(); err != nil {
		return nil, err
	}
	cfg.Metrics.Listen = env.metrics
	cfg.Log.Level = "warn"
	cfg.Log.Format = "json"
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	data, err := yaml.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	if data, err = applySets(data, b.p.Sets); err != nil {
		return nil, err
	}
	// Check the result the way `walbox run` will read it.
	if err := os.WriteFile(filepath.Join(env.tmp, "check.yaml"), data, 0o600); err != nil {
		return nil, err
	}
	if c, err := config.Load(filepath.Join(env.tmp, "check.yaml"), nil); err != nil {
		return nil, fmt.Errorf("-set: %w", err)
	} else if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("-set: %w", err)
	}
	env.cfgFile = filepath.Join(env.tmp, "walbox.yaml")
	if err := os.WriteFile(env.cfgFile, data, 0o600); err != nil {
		return nil, err
	}

	env.info.CPUs = runtime.NumCPU()
	env.info.CPUModel, env.info.MemTotal = cpuModel(), memTotal()
	if k, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		env.info.Kernel = strings.TrimSpace(string(k))
	}
	env.info.GoVersion = runtime.Version()
	env.info.Walbox = "unknown revision"
	if bi, err := buildinfo.ReadFile(env.binary); err == nil {
		env.info.GoVersion = bi.GoVersion
		if rev, modified := vcs.Revision(bi.Settings); rev != "" {
			env.info.Walbox = rev
			if modified {
				env.info.Walbox += " + uncommitted changes"
			}
		}
	}
	if env.info.Walbox == "unknown revision" { // built with -buildvcs=false
		if rev := gitHead(env.moduleDir); rev != "" {
			env.info.Walbox = rev + " (uncommitted changes not detected: -buildvcs=false)"
		}
	}
	env.info.NATS = server.VERSION
	b.logf("setup done in %.1fs: PostgreSQL %s (%s), nats-server %s, %s", time.Since(t0).Seconds(),
		env.info.PGVersion, env.info.PGSet, env.info.NATS, env.info.GoVersion)
	return env, nil
}

// goTool finds the go command that runs this benchmark.
func goTool() (string, error) {
	if p := filepath.Join(runtime.GOROOT(), "bin", "go"); runtime.GOROOT() != "" {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	p, err := exec.LookPath("go")
	if err != nil {
		return "", errors.New("the go command is needed to build walbox: not found on PATH")
	}
	return p, nil
}

func cpuModel() string {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown"
}

func memTotal() string {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return "unknown"
	}
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "MemTotal:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return fmt.Sprintf("%.1f GiB", kb/1024/1024)
		}
	}
	return "unknown"
}

// --- processes ---------------------------------------------------------------

// clockTick is USER_HZ, the unit of utime/stime in /proc/<pid>/stat; 100 on
// every Linux architecture Go supports.
const clockTick = 10 * time.Millisecond

// procCPU returns user+sys CPU time of pid (all its threads).
func procCPU(pid int) (time.Duration, error) { return procStatTicks(pid, 11, 12) }

// sysmonCPU returns the user+sys CPU of a Go program's sysmon thread: the
// runtime's monitor, the first thread runtime.main starts, so the
// lowest-numbered thread after the main one (thread ids count up; a wrap
// of the pid space between the two would mislead it). In a process that
// goes idle between events, every wake-up's first system call wakes sysmon
// from its deep sleep, and it then polls every 20 µs until the process is
// idle again (golang/go#18236): CPU that no profile of the program shows.
func sysmonCPU(pid int) (time.Duration, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, err
	}
	tid := 0
	for _, e := range ents {
		if t, err := strconv.Atoi(e.Name()); err == nil && t != pid && (tid == 0 || t < tid) {
			tid = t
		}
	}
	if tid == 0 {
		return 0, fmt.Errorf("process %d has no thread besides its main one", pid)
	}
	return procStatTicksPath(fmt.Sprintf("/proc/%d/task/%d/stat", pid, tid), 11, 12)
}

// procChildCPU returns the user+sys CPU of pid's children that exited and
// were waited for (cutime+cstime): for the postmaster, its backends and
// walsenders that ended.
func procChildCPU(pid int) (time.Duration, error) { return procStatTicks(pid, 13, 14) }

// procStatTicks sums two clock-tick fields of /proc/<pid>/stat, counted from
// the first field after the command name (which may contain spaces).
func procStatTicks(pid, first, second int) (time.Duration, error) {
	return procStatTicksPath("/proc/"+strconv.Itoa(pid)+"/stat", first, second)
}

// procStatTicksPath is procStatTicks for a stat file: a process's or a
// thread's.
func procStatTicksPath(path string, first, second int) (time.Duration, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("%s: unexpected format", path)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) <= max(first, second) {
		return 0, fmt.Errorf("%s: unexpected format", path)
	}
	x, err1 := strconv.ParseInt(f[first], 10, 64)
	y, err2 := strconv.ParseInt(f[second], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("%s: unexpected format", path)
	}
	return time.Duration(x+y) * clockTick, nil
}

// procWait is how long pid's threads have been runnable but waiting for a
// CPU, from /proc/<pid>/task/*/schedstat (the second field, ns): a Go
// process runs on several threads; threads that exited are not counted.
func procWait(pid int) time.Duration {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0
	}
	var sum time.Duration
	for _, t := range tasks {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, t.Name()))
		if err != nil {
			continue
		}
		if f := strings.Fields(string(data)); len(f) >= 2 {
			if ns, err := strconv.ParseInt(f[1], 10, 64); err == nil {
				sum += time.Duration(ns)
			}
		}
	}
	return sum
}

// procHWM returns the peak resident set size (VmHWM) of pid in bytes.
func procHWM(pid int) (int64, error) { return procStatusBytes(pid, "VmHWM:") }

// procWakeups returns how often pid's threads blocked and were woken
// again: their voluntary context switches, summed over
// /proc/<pid>/task/*/status (threads that exited are not counted).
func procWakeups(pid int) (uint64, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, err
	}
	var sum uint64
	for _, t := range tasks {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, t.Name()))
		if err != nil {
			continue // the thread exited
		}
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "voluntary_ctxt_switches:"); ok {
				n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
				if err != nil {
					return 0, fmt.Errorf("/proc/%d/task/%s/status: %w", pid, t.Name(), err)
				}
				sum += n
			}
		}
	}
	return sum, nil
}

// wakeupsSince returns pid's wake-ups since it had w0 (0: it is gone).
func wakeupsSince(pid int, w0 uint64) uint64 {
	w, err := procWakeups(pid)
	if err != nil || w < w0 {
		return 0
	}
	return w - w0
}

// selfCPU is this process's user+sys time: the embedded nats-server and the
// benchmark driver.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// machineBusy reads /proc/stat: busy and total jiffies over all CPUs.
func machineBusy() (busy, total, irq int64) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return 0, 0, 0
	}
	for i, s := range f[1:] {
		if i >= 8 { // guest time is already counted in user
			break
		}
		v, _ := strconv.ParseInt(s, 10, 64)
		total += v
		if i != 3 && i != 4 { // idle, iowait
			busy += v
		}
		if i == 5 || i == 6 { // irq, softirq
			irq += v
		}
	}
	return busy, total, irq
}

// cpuMeter measures the whole machine's CPU use between start and stop.
type cpuMeter struct{ busy, total, irq int64 }

func startCPUMeter() cpuMeter {
	b, t, i := machineBusy()
	return cpuMeter{b, t, i}
}

// busyShare returns the share of all CPUs that was busy since start (0..1)
// and the time spent in interrupts and softirqs (no process is charged).
func (m cpuMeter) busyShare() (float64, time.Duration) {
	b, t, i := machineBusy()
	if t-m.total <= 0 {
		return 0, 0
	}
	return float64(b-m.busy) / float64(t-m.total), time.Duration(i-m.irq) * clockTick
}

// tailBuffer keeps the last bytes written, for error messages.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > 64<<10 {
		t.buf = append([]byte(nil), t.buf[len(t.buf)-32<<10:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.buf)
}

// relayProc is the walbox binary running `walbox run`.
type relayProc struct {
	phase   string
	cmd     *exec.Cmd
	started time.Time
	done    chan struct{}
	logs    *tailBuffer
}

// startRelay spawns the relay. It is killed at cleanup if still running.
func (b *bench) startRelay(phase string, env ...string) (*relayProc, error) {
	prog, args, err := b.relayCommand(phase)
	if err != nil {
		return nil, err
	}
	if prog != b.env.binary {
		env = append([]string{"GODEBUG=" + walboxGODEBUG}, env...)
	}
	if b.p.RelayEnv != "" {
		env = append(env, strings.Split(b.p.RelayEnv, ",")...)
	}
	return b.startProc(phase, prog, args, env...)
}

// startProc spawns a relay under test (walbox or a peer) with the
// environment of the benchmark minus WALBOX_* plus env.
func (b *bench) startProc(phase, prog string, args []string, env ...string) (*relayProc, error) {
	p := &relayProc{phase: phase, done: make(chan struct{}), logs: &tailBuffer{}}
	p.cmd = exec.Command(prog, args...)
	p.cmd.Stdout, p.cmd.Stderr = p.logs, p.logs
	// Its own process group, so Ctrl-C reaches the benchmark only and the
	// benchmark stops the relay; killed if the benchmark dies.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	for _, kv := range os.Environ() {
		// Neither walbox's settings nor OpenTelemetry's: a relay traces
		// only in the phases that say so (tracing.go).
		if !strings.HasPrefix(kv, "WALBOX_") && !strings.HasPrefix(kv, "OTEL_") {
			p.cmd.Env = append(p.cmd.Env, kv)
		}
	}
	p.cmd.Env = append(p.cmd.Env, env...)
	p.started = time.Now()
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", filepath.Base(prog), err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	b.onCleanup(func() { p.kill() })
	return p, nil
}

func (p *relayProc) pid() int { return p.cmd.Process.Pid }

func (p *relayProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// warnings returns the relay's log lines (it logs at warn level and up).
func (p *relayProc) warnings() []string {
	var out []string
	for _, l := range strings.Split(strings.TrimSpace(p.logs.String()), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return out
}

// stop sends SIGTERM and waits for a clean exit (SIGKILL after 30 s).
func (p *relayProc) stop() error {
	if p.exited() {
		return fmt.Errorf("relay had exited already: %s\n%s", p.cmd.ProcessState, p.logs)
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		p.kill()
		return fmt.Errorf("relay did not exit within 30s of SIGTERM; killed\n%s", p.logs)
	}
	if !p.cmd.ProcessState.Success() {
		return fmt.Errorf("relay exited with %s\n%s", p.cmd.ProcessState, p.logs)
	}
	return nil
}

func (p *relayProc) kill() {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// cpu and hwm read the running relay's CPU time and peak RSS.
func (p *relayProc) cpu() (time.Duration, error) { return procCPU(p.pid()) }
func (p *relayProc) hwm() (int64, error)         { return procHWM(p.pid()) }

// slotState reads a slot: whether it is active and its walsender's pid.
func (b *bench) slotState(ctx context.Context, slot string) (active bool, pid int, err error) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err = b.env.pool.QueryRow(qctx,
		"SELECT coalesce(bool_or(active), false), coalesce(max(active_pid), 0) FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&active, &pid)
	return active, pid, err
}

// startStreaming spawns the relay and waits until it streams from the
// slot; it returns the relay and its walsender's pid.
func (b *bench) startStreaming(ctx context.Context, phase string, env ...string) (*relayProc, int, error) {
	r, err := b.startRelay(phase, env...)
	if err != nil {
		return nil, 0, err
	}
	wsPID, err := b.waitSlot(ctx, slotName, true, r)
	if err != nil {
		return nil, 0, err
	}
	return r, wsPID, nil
}

// waitSlot waits until the slot is active (returning the walsender pid) or
// inactive. A relay that exits meanwhile is an error.
func (b *bench) waitSlot(ctx context.Context, slot string, wantActive bool, p *relayProc) (int, error) {
	deadline := time.Now().Add(b.p.Stall)
	for {
		active, pid, err := b.slotState(ctx, slot)
		if err == nil && active == wantActive {
			return pid, nil
		}
		if p != nil && p.exited() {
			return 0, fmt.Errorf("relay exited (%s):\n%s", p.cmd.ProcessState, p.logs)
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("slot %s not active=%v within %s (last error: %v)", slot, wantActive, b.p.Stall, err)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// pollAcked reads once how many messages stream holds, stores how many of
// them are past base with store and says whether target is reached. A process
// that exited fails with exitedErr and its log; otherwise it waits 20 ms
// (or for ctx) before returning false.
func (b *bench) pollAcked(ctx context.Context, stream string, base, target uint64, store func(int64), p *relayProc, exitedErr string) (bool, error) {
	n, err := b.streamMsgs(ctx, stream)
	if err == nil {
		store(int64(n - base))
		if n >= target {
			return true, nil
		}
	}
	if p.exited() {
		return false, fmt.Errorf("%s (%s):\n%s", exitedErr, p.cmd.ProcessState, p.logs)
	}
	select {
	case <-ctx.Done():
		return false, cause(ctx, ctx.Err())
	case <-time.After(20 * time.Millisecond):
	}
	return false, nil
}

// streamMsgs returns the number of messages in a stream.
func (b *bench) streamMsgs(ctx context.Context, name string) (uint64, error) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := b.env.js.Stream(qctx, name)
	if err != nil {
		return 0, err
	}
	info, err := st.Info(qctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}

// streamMsg reads one stored message (for its stored timestamp and headers).
func (b *bench) streamMsg(ctx context.Context, name string, seq uint64) (*jetstream.RawStreamMsg, error) {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	st, err := b.env.js.Stream(qctx, name)
	if err != nil {
		return nil, err
	}
	return st.GetMsg(qctx, seq)
}

// firstLast reads the messages at sequences first and last of a stream:
// their stored timestamps bound a phase.
func (b *bench) firstLast(ctx context.Context, stream string, first, last uint64) (*jetstream.RawStreamMsg, *jetstream.RawStreamMsg, error) {
	f, err := b.streamMsg(ctx, stream, first)
	if err != nil {
		return nil, nil, err
	}
	l, err := b.streamMsg(ctx, stream, last)
	if err != nil {
		return nil, nil, err
	}
	return f, l, nil
}

// walLSN returns pg_current_wal_lsn() as a number (0 on error).
func (b *bench) walLSN(ctx context.Context) int64 {
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var n int64
	_ = b.env.pool.QueryRow(qctx, "SELECT (pg_current_wal_lsn() - '0/0')::bigint").Scan(&n)
	return n
}

// --- where the CPU went ------------------------------------------------------

// procSample is one process's label and CPU time.
type procSample struct {
	label  string
	cpu    time.Duration
	wait   time.Duration // runnable but waiting for a CPU (schedstat)
	parent int           // -1: a child of the postmaster, -2: of this process
}

// cpuShare is the CPU used by one group of processes during a phase.
type cpuShare struct {
	Label string
	CPU   time.Duration
	Wait  time.Duration // of the group's processes alive at the end: runnable, waiting for a CPU
}

// procSnapshot reads the CPU time of every process on the machine.
func (b *bench) procSnapshot(relayPID int) map[int]procSample {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	self, pm := os.Getpid(), b.postmasterPID()
	snap := make(map[int]procSample, len(entries))
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cpu, err := procCPU(pid)
		if err != nil {
			continue
		}
		ps := procSample{label: procLabel(pid, self, relayPID, pm), cpu: cpu, wait: procWait(pid)}
		switch procPPID(pid) {
		case pm:
			ps.parent = -1
		case self:
			ps.parent = -2
		}
		snap[pid] = ps
		if ps.parent < 0 {
			b.mu.Lock()
			if b.seen == nil {
				b.seen, b.accounted = map[int]procSample{}, map[int]bool{}
			}
			if prev, ok := b.seen[pid]; !ok || cpu > prev.cpu {
				b.seen[pid] = ps
			}
			b.mu.Unlock()
		}
	}
	// Processes that exited are charged to their parent once reaped: the
	// postmaster's backends and walsenders, this process's children (the
	// relay, pg_recvlogical).
	if pm != 0 {
		if c, err := procChildCPU(pm); err == nil {
			snap[-1] = procSample{label: "postgres exited backends and walsenders", cpu: c}
		}
	}
	if c, err := procChildCPU(self); err == nil {
		snap[-2] = procSample{label: "exited children of the bench (relay, pg_recvlogical)", cpu: c}
	}
	return snap
}

// postmasterPID is the benchmark cluster's postmaster (0 if unknown).
func (b *bench) postmasterPID() int {
	if b.env == nil || b.env.pg == nil {
		return 0
	}
	data, err := os.ReadFile(filepath.Join(b.env.pg.DataDir(), "postmaster.pid"))
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	pid, _ := strconv.Atoi(strings.TrimSpace(line))
	return pid
}

// procPPID returns the parent pid from /proc/<pid>/stat.
func procPPID(pid int) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return 0
	}
	ppid, _ := strconv.Atoi(f[1])
	return ppid
}

// procLabel groups processes: the relay, this process, the benchmark
// cluster's PostgreSQL processes by role, everything else (including other
// PostgreSQL clusters on the machine) by command name.
func procLabel(pid, self, relay, postmaster int) string {
	switch pid {
	case self:
		return "bench driver + nats-server"
	case postmaster:
		return "postgres postmaster"
	}
	comm, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	name := strings.TrimSpace(string(comm))
	if pid == relay {
		if name == "walbox" {
			return "walbox relay"
		}
		if args, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); bytes.Contains(args, []byte(bareRelayArg)) {
			return "bare relay"
		}
		return "relay under test (" + name + ")"
	}
	if name == "pg_recvlogical" {
		return name
	}
	if procPPID(pid) == self {
		return "bench child (" + name + ")"
	}
	if postmaster == 0 || procPPID(pid) != postmaster {
		return "other: " + name
	}
	raw, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	cmd := strings.TrimSpace(strings.ReplaceAll(string(raw), "\x00", " "))
	rest, ok := strings.CutPrefix(cmd, "postgres: ")
	if !ok {
		return "postgres (exiting, e.g. a walsender)"
	}
	for _, role := range []string{"walsender", "checkpointer", "background writer", "walwriter",
		"autovacuum launcher", "autovacuum worker", "logical replication launcher", "stats collector", "archiver"} {
		if strings.HasPrefix(rest, role) {
			return "postgres " + role
		}
	}
	return "postgres backends"
}

// cpuDelta sums the CPU used between two snapshots by label, largest first.
// Processes that started in between count in full; ones that exited in
// between are lost (see "unattributed").
func cpuDelta(before, after map[int]procSample, busy, irq time.Duration, gone map[int]time.Duration) []cpuShare {
	sums, waits := map[string]time.Duration{}, map[string]time.Duration{}
	var total time.Duration
	for pid, a := range after {
		d, w := a.cpu, a.wait
		if bs, ok := before[pid]; ok {
			d -= bs.cpu
			w -= bs.wait
		}
		if pid < 0 {
			d -= gone[pid]
		}
		if d > 0 {
			sums[a.label] += d
			total += d
		}
		if w > 0 {
			waits[a.label] += w
		}
	}
	var out []cpuShare
	for l, d := range sums {
		out = append(out, cpuShare{Label: l, CPU: d, Wait: waits[l]})
	}
	if irq >= 10*time.Millisecond {
		out = append(out, cpuShare{Label: "kernel irq/softirq (mostly loopback networking)", CPU: irq})
		total += irq
	}
	if busy > total+20*time.Millisecond {
		out = append(out, cpuShare{Label: "unattributed (exited processes, kernel)", CPU: busy - total})
	}
	slices.SortFunc(out, func(x, y cpuShare) int { return int(y.CPU - x.CPU) })
	return out
}

// phaseMeter measures one phase: machine busy share and CPU by process.
type phaseMeter struct {
	b      *bench
	relay  int
	start  time.Time
	busy   cpuMeter
	before map[int]procSample
}

func (b *bench) startPhase(relayPID int) *phaseMeter {
	m := &phaseMeter{b: b, relay: relayPID, start: time.Now(), busy: startCPUMeter(), before: b.procSnapshot(relayPID)}
	b.reaped(m.before) // already in the parents' reaped CPU at the start
	return m
}

// reaped returns, by parent (-1 postmaster, -2 this process), the CPU last
// seen of children that have gone since they were last seen: their parent's
// reaped CPU now holds their whole life, which earlier phases counted.
func (b *bench) reaped(snap map[int]procSample) map[int]time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	gone := map[int]time.Duration{}
	for pid, ps := range b.seen {
		if _, alive := snap[pid]; alive || b.accounted[pid] {
			continue
		}
		b.accounted[pid] = true
		gone[ps.parent] += ps.cpu
	}
	return gone
}

// stop returns the busy share of all CPUs, the CPU by process group and the
// time measured.
func (m *phaseMeter) stop() (float64, []cpuShare, time.Duration) {
	after := m.b.procSnapshot(m.relay)
	share, irq := m.busy.busyShare()
	busy := time.Duration(share * float64(time.Since(m.start)) * float64(runtime.NumCPU()))
	return share, cpuDelta(m.before, after, busy, irq, m.b.reaped(after)), time.Since(m.start)
}

// applySets overrides keys of the relay's YAML config: each set is
// dotted.key=value, the value a YAML scalar (e.g. sweeper.mark_processed=false).
func applySets(data []byte, sets []string) ([]byte, error) {
	if len(sets) == 0 {
		return data, nil
	}
	var doc map[string]any
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, err
	}
	for _, set := range sets {
		key, raw, ok := strings.Cut(set, "=")
		if !ok || key == "" {
			return nil, fmt.Errorf("-set %q: use key.path=value", set)
		}
		var val any
		if err := yaml.Unmarshal([]byte(raw), &val); err != nil {
			return nil, fmt.Errorf("-set %q: %w", set, err)
		}
		m := doc
		parts := strings.Split(key, ".")
		for _, k := range parts[:len(parts)-1] {
			sub, ok := m[k].(map[string]any)
			if !ok {
				sub = map[string]any{}
				m[k] = sub
			}
			m = sub
		}
		m[parts[len(parts)-1]] = val
	}
	return yaml.Marshal(doc)
}

// gitHead is the commit checked out in dir (git rev-parse), or "".
func gitHead(dir string) string {
	// git itself: .git is a file in a worktree, and HEAD may be detached.
	out, err := exec.Command("git", "-C", dir, "rev-parse", "--short=12", "HEAD").Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

// stopRelay stops the relay and shows what it logged (warnings and errors).
func (b *bench) stopRelay(p *relayProc) error {
	err := p.stop()
	if w := p.warnings(); len(w) > 0 {
		b.logf("  relay (%s) logged %d warning/error lines, first: %s", p.phase, len(w), truncate(w[0], 300))
		b.res.relayWarnings = append(b.res.relayWarnings, fmt.Sprintf("%s: %d lines, first: %s", p.phase, len(w), truncate(w[0], 300)))
	}
	return err
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
