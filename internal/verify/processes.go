package verify

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
)

// workerEnv, when set in a process's environment, makes [WorkerMain] run
// it as a consumer process of [RunProcesses]. Its value is the worker's
// specification in JSON.
const workerEnv = "DEDUP_VERIFY_WORKER"

// MaxProcesses bounds ProcessOptions.Processes.
const MaxProcesses = 64

// workerOpenTimeout bounds how long a worker may take to open the store.
const workerOpenTimeout = time.Minute

// ProcessOptions configure [RunProcesses].
type ProcessOptions struct {
	// Processes is how many consumer processes run at once, each with
	// Config.Consumers goroutines. Between 1 and MaxProcesses.
	Processes int
	// Command starts one worker: a program and its arguments. The program
	// must call [WorkerMain] first thing (`dedup verify` does). Default:
	// this executable with no arguments.
	Command []string
	// KillEvery SIGKILLs a worker process chosen at random every
	// KillEvery deliveries, and starts a new one in its place; 0 never.
	KillEvery int
}

// workerSpec is what a worker needs to attach to its parent's store.
type workerSpec struct {
	Backend   string      `json:"backend"`
	Open      OpenOptions `json:"open"`
	Consumers int         `json:"consumers"`
}

// wireDelivery is one delivery on a worker's standard input.
type wireDelivery struct {
	Tag         uint64 `json:"t"`
	Seq         int    `json:"s"`
	ID          string `json:"id"`
	Redelivered int    `json:"r,omitempty"`
	Fault       Fault  `json:"f,omitempty"`
}

// wireResult is a worker's answer on its standard output: first a line
// with Ready (or Err, if it could not open the store), then one line per
// delivery.
type wireResult struct {
	Tag        uint64        `json:"t,omitempty"`
	Ready      bool          `json:"ready,omitempty"`
	Outcome    Outcome       `json:"o,omitempty"`
	TakenOver  bool          `json:"to,omitempty"`
	RetryAfter time.Duration `json:"ra,omitempty"`
	Took       time.Duration `json:"d,omitempty"`
	Err        string        `json:"e,omitempty"`
	// Final is the last line of a worker that finished cleanly, with
	// what its layers caught (a layered store).
	Final   bool             `json:"final,omitempty"`
	Layers  map[string]int64 `json:"layers,omitempty"`
	Flushes int              `json:"flushes,omitempty"`
}

// WorkerMain runs this process as a consumer process of [RunProcesses]
// when its environment says so, and returns the exit status with isWorker
// set; otherwise it returns at once with isWorker false. A worker opens
// the store its parent names (attached: it creates and drops nothing),
// reads deliveries from stdin, applies them with its consumers and writes
// each result to stdout, until stdin ends.
func WorkerMain(stdin io.Reader, stdout, stderr io.Writer) (code int, isWorker bool) {
	raw, ok := os.LookupEnv(workerEnv)
	if !ok {
		return 0, false
	}
	var enc struct {
		sync.Mutex
		*json.Encoder
	}
	enc.Encoder = json.NewEncoder(stdout)
	fail := func(err error) (int, bool) {
		enc.Encode(wireResult{Err: err.Error()})
		fmt.Fprintf(stderr, "dedup verify worker %d: %v\n", os.Getpid(), err)
		return 1, true
	}
	var spec workerSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		return fail(fmt.Errorf("bad %s: %w", workerEnv, err))
	}
	b, ok := LookupBackend(spec.Backend)
	if !ok {
		return fail(fmt.Errorf("no store %q", spec.Backend))
	}
	spec.Open.Attach = true
	octx, cancel := context.WithTimeout(context.Background(), workerOpenTimeout)
	t, err := b.Open(octx, spec.Open)
	cancel()
	if err != nil {
		return fail(fmt.Errorf("open the %s store: %w", spec.Backend, err))
	}
	if err := enc.Encode(wireResult{Ready: true}); err != nil {
		t.Close()
		return 1, true
	}
	ctx := context.Background()
	in := make(chan wireDelivery)
	var wg sync.WaitGroup
	for range max(spec.Consumers, 1) {
		wg.Go(func() {
			for w := range in {
				d := Delivery{
					Seq: w.Seq, MsgID: w.ID, Key: dedup.Key{Scope: scope, ID: w.ID},
					Fingerprint: dedup.FingerprintOf(payloadOf(w.ID, w.Seq)),
					Redelivered: w.Redelivered, Fault: w.Fault,
				}
				start := time.Now()
				res := t.Apply(ctx, d)
				out := wireResult{Tag: w.Tag, Outcome: res.Outcome, TakenOver: res.TakenOver,
					RetryAfter: res.RetryAfter, Took: time.Since(start)}
				if res.Err != nil {
					out.Err = res.Err.Error()
				}
				enc.Lock()
				enc.Encode(out)
				enc.Unlock()
			}
		})
	}
	dec := json.NewDecoder(stdin)
	var readErr error
	for {
		var w wireDelivery
		if err := dec.Decode(&w); err != nil {
			if !errors.Is(err, io.EOF) {
				readErr = err
			}
			break
		}
		in <- w
	}
	close(in)
	wg.Wait()
	if ls, ok := t.(LayerReporter); ok {
		layers, flushes := ls.LayerStats()
		enc.Encode(wireResult{Final: true, Layers: layers, Flushes: flushes})
	}
	if err := errors.Join(readErr, t.Close()); err != nil {
		fmt.Fprintf(stderr, "dedup verify worker %d: %v\n", os.Getpid(), err)
		return 1, true
	}
	return 0, true
}

// RunProcesses is [Run] with the consumers in po.Processes separate OS
// processes (workers) instead of goroutines, all attached to one store
// that this process opens with backend and o: one SQLite file, one Redis
// (or Redis Cluster) key space, one PostgreSQL schema. This process runs
// the simulated broker and hands each worker its deliveries over a pipe.
// Every po.KillEvery deliveries it SIGKILLs a worker chosen at random, the
// crash a pod gets: the deliveries in flight there are never acknowledged
// and the broker redelivers them after the visibility timeout, while a new
// worker starts in its place.
//
// The verdict comes from the shared ledger: the SQL table written in the
// inbox transaction, or in lease mode a file every worker appends its
// effects to. In lease mode a process killed between its effect and
// Complete applies that message twice once the lease is taken over; the
// report counts such doubles in KillWindowDoubles, and they still fail
// the run. The memory store cannot be shared and is refused.
func RunProcesses(ctx context.Context, cfg Config, backend Backend, o OpenOptions, po ProcessOptions) (_ Report, err error) {
	if po.Processes < 1 || po.Processes > MaxProcesses {
		return Report{}, fmt.Errorf("--processes must be between 1 and %d, got %d", MaxProcesses, po.Processes)
	}
	if po.KillEvery < 0 {
		return Report{}, fmt.Errorf("--kill-every must be 0 (never) or a count of deliveries, got %d", po.KillEvery)
	}
	if backend.Name == "memory" {
		return Report{}, errors.New("verify: the memory store lives in one process and cannot be shared by several; use sqlite, redis, postgres or layered")
	}
	if err := cfg.Validate(); err != nil {
		return Report{}, err
	}
	if len(po.Command) == 0 {
		exe, err := os.Executable()
		if err != nil {
			return Report{}, fmt.Errorf("verify: find this executable to start the workers: %w", err)
		}
		po.Command = []string{exe}
	}
	if o.Mode == "" {
		o.Mode = backend.Modes[0]
	}

	// What the processes share: the database file, the schema, the Redis
	// prefix, the lease-mode ledger file.
	dir, err := os.MkdirTemp("", "dedup-verify-procs-")
	if err != nil {
		return Report{}, fmt.Errorf("verify: create a temporary directory: %w", err)
	}
	userPath := o.Path
	if backend.UsesPath && o.Path == "" {
		o.Path = filepath.Join(dir, "verify.db")
	}
	if o.Schema == "" && (backend.Name == "postgres" || backend.Name == "layered" && o.Durable == "postgres") {
		o.Schema = fmt.Sprintf("dedup_verify_%012x", rand.Uint64()>>16)
	}
	if o.RedisPrefix == "" && backend.Name == "layered" {
		o.RedisPrefix = fmt.Sprintf("dedup-verify-%016x:", rand.Uint64())
	}
	if o.Mode == LeaseMode {
		o.LedgerFile = filepath.Join(dir, "ledger")
	}
	t, err := backend.Open(ctx, o)
	if err != nil {
		os.RemoveAll(dir)
		return Report{}, err
	}
	defer func() {
		err = errors.Join(err, t.Close())
		if !o.Keep {
			err = errors.Join(err, os.RemoveAll(dir))
		}
	}()

	b, err := start(cfg, t, "simulated")
	if err != nil {
		return Report{}, err
	}
	cfg = b.cfg
	b.report.Processes = po.Processes
	spec, err := json.Marshal(workerSpec{Backend: backend.Name, Open: o, Consumers: cfg.Consumers})
	if err != nil {
		return Report{}, err
	}

	rctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	ps := &procSet{command: po.Command, env: workerEnv + "=" + string(spec), fail: cancel,
		deaths: map[int]map[string]bool{}, rng: rand.New(rand.NewPCG(cfg.Seed, 7))}
	ps.slots = make([]*slot, po.Processes)
	for i := range ps.slots {
		ps.slots[i] = &slot{set: ps}
	}

	out := make(chan Delivery)
	consumers := po.Processes * cfg.Consumers
	results := make(chan settled, consumers)
	var wg sync.WaitGroup
	for i := range consumers {
		sl := ps.slots[i%po.Processes]
		wg.Go(func() {
			for d := range out {
				if n := ps.delivered.Add(1); po.KillEvery > 0 && n%int64(po.KillEvery) == 0 {
					ps.killOne()
				}
				start := time.Now()
				res := sl.apply(rctx, d)
				results <- settled{d: d, res: res, took: time.Since(start)}
			}
			results <- settled{exit: true}
		})
	}
	stopped := b.loop(rctx, out, results)
	if stopped {
		// Nothing more is acknowledged: stop the workers, so that the
		// consumers waiting on them return.
		ps.shutdown(true)
	}
	for left := 0; left < consumers; {
		if r := <-results; r.exit {
			left++
		} else {
			b.settle(r, false)
		}
	}
	wg.Wait()
	ps.shutdown(false)
	if cause := context.Cause(rctx); cause != nil && ctx.Err() == nil {
		return b.report, fmt.Errorf("verify: %w", cause)
	}

	rep, err := b.conclude(ctx, t, stopped)
	ps.mu.Lock()
	// The layers of the workers that finished cleanly (a killed worker's
	// counts die with it); this process's own target applied nothing.
	rep.Layers, rep.Flushes = ps.layers, ps.flushes
	rep.ProcessKills, rep.ProcessStarts = ps.kills, ps.starts
	ps.mu.Unlock()
	if err != nil {
		return rep, err
	}
	if fl := fileLedgerOf(t); fl != nil && rep.DoubleApplied > 0 {
		rows, err := fl.rows(b.prefix)
		if err != nil {
			return rep, fmt.Errorf("verify: check the ledger: %w", err)
		}
		ps.mu.Lock()
		rep.KillWindowDoubles = killWindowDoubles(rows, ps.deaths)
		ps.mu.Unlock()
	}
	if o.Keep || userPath != "" {
		rep.Path = PathOf(t)
	}
	return rep, nil
}

// killWindowDoubles counts the messages applied more than once whose
// every extra effect came from a process that died with the message in
// flight.
func killWindowDoubles(rows map[string][]int, deaths map[int]map[string]bool) int {
	n := 0
	for id, pids := range rows {
		if len(pids) < 2 {
			continue
		}
		dead := 0
		for _, pid := range pids {
			if deaths[pid][id] {
				dead++
			}
		}
		if dead >= len(pids)-1 {
			n++
		}
	}
	return n
}

// fileLedgerOf returns the ledger file of a lease-mode target, if it has
// one.
func fileLedgerOf(t Target) *fileLedger {
	for t != nil {
		switch x := t.(type) {
		case *LeaseTarget:
			fl, _ := x.ledger.(*fileLedger)
			return fl
		case *fileTarget:
			t = x.Target
		case *pgTarget:
			t = x.Target
		default:
			return nil
		}
	}
	return nil
}

// procSet is the worker processes of one run.
type procSet struct {
	command []string
	env     string
	fail    context.CancelCauseFunc
	slots   []*slot

	delivered atomic.Int64
	stderr    tailBuffer

	mu       sync.Mutex
	rng      *rand.Rand
	kills    int
	starts   int
	failures int                     // workers in a row that could not start
	deaths   map[int]map[string]bool // pid -> message IDs in flight when it died
	closed   bool
	layers   map[string]int64 // summed over the workers that finished cleanly
	flushes  int
}

// slot is one place for a worker process; it starts a new one when its
// worker has died.
type slot struct {
	set *procSet
	mu  sync.Mutex
	cur *worker
}

// apply hands d to the slot's worker, starting one if needed, and waits
// for its result.
func (s *slot) apply(ctx context.Context, d Delivery) Result {
	w, err := s.get(ctx)
	if err != nil {
		return Result{Outcome: StoreFailed, Err: err}
	}
	return w.apply(d)
}

func (s *slot) get(ctx context.Context) (*worker, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur != nil && !s.cur.gone() {
		return s.cur, nil
	}
	w, err := s.set.spawn(ctx)
	if err != nil {
		return nil, err
	}
	s.cur = w
	return w, nil
}

func (s *slot) current() *worker {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

// maxStartFailures ends a run whose workers keep failing to start.
const maxStartFailures = 3

// spawn starts a worker and waits until it has opened the store.
func (ps *procSet) spawn(ctx context.Context) (*worker, error) {
	ps.mu.Lock()
	closed := ps.closed
	ps.mu.Unlock()
	if closed || ctx.Err() != nil {
		return nil, errors.New("verify: the run is over")
	}
	w, err := ps.startWorker(ctx)
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if err != nil {
		ps.failures++
		if ps.failures >= maxStartFailures {
			ps.fail(fmt.Errorf("%d worker processes in a row failed to start; the last: %w", ps.failures, err))
		}
		return nil, err
	}
	ps.failures = 0
	ps.starts++
	return w, nil
}

func (ps *procSet) startWorker(ctx context.Context) (*worker, error) {
	cmd := exec.Command(ps.command[0], ps.command[1:]...)
	cmd.Env = append(os.Environ(), ps.env)
	cmd.Stderr = &ps.stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start a worker process: %w", err)
	}
	w := &worker{set: ps, cmd: cmd, pid: cmd.Process.Pid, stdin: stdin, enc: json.NewEncoder(stdin),
		dec: json.NewDecoder(stdout), pending: map[uint64]pendingDelivery{}, dead: make(chan struct{})}
	ready := make(chan error, 1)
	go func() {
		var r wireResult
		err := w.dec.Decode(&r)
		switch {
		case err != nil:
			err = fmt.Errorf("worker process %d ended before it was ready (%v): %s", w.pid, err, ps.stderr.String())
		case r.Err != "":
			err = fmt.Errorf("worker process %d: %s", w.pid, r.Err)
		case !r.Ready:
			err = fmt.Errorf("worker process %d: no ready line", w.pid)
		}
		ready <- err
	}()
	timer := time.NewTimer(workerOpenTimeout)
	defer timer.Stop()
	select {
	case err = <-ready:
	case <-ctx.Done():
		err = ctx.Err()
	case <-timer.C:
		err = fmt.Errorf("worker process %d not ready after %v", w.pid, workerOpenTimeout)
	}
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, err
	}
	go w.read()
	return w, nil
}

// killOne SIGKILLs a worker chosen at random, if it is running.
func (ps *procSet) killOne() {
	ps.mu.Lock()
	if ps.closed {
		ps.mu.Unlock()
		return
	}
	s := ps.slots[ps.rng.IntN(len(ps.slots))]
	ps.mu.Unlock()
	w := s.current()
	if w == nil || w.gone() {
		return
	}
	if w.killed.CompareAndSwap(false, true) {
		if w.cmd.Process.Kill() == nil {
			ps.mu.Lock()
			ps.kills++
			ps.mu.Unlock()
		}
	}
}

// shutdown stops the workers: at once with SIGKILL when kill is set,
// else by closing their input and waiting for them to finish.
func (ps *procSet) shutdown(kill bool) {
	ps.mu.Lock()
	ps.closed = true
	ps.mu.Unlock()
	for _, s := range ps.slots {
		w := s.current()
		if w == nil {
			continue
		}
		if kill {
			w.cmd.Process.Kill()
			continue
		}
		w.stdin.Close()
		select {
		case <-w.dead:
		case <-time.After(30 * time.Second):
			w.cmd.Process.Kill()
			<-w.dead
		}
	}
}

// recordDeath notes which messages were in flight on a worker that died.
func (ps *procSet) recordDeath(pid int, ids map[string]bool) {
	ps.mu.Lock()
	ps.deaths[pid] = ids
	ps.mu.Unlock()
}

func (ps *procSet) addLayers(m map[string]int64, flushes int) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if len(m) > 0 && ps.layers == nil {
		ps.layers = map[string]int64{}
	}
	for k, v := range m {
		ps.layers[k] += v
	}
	ps.flushes += flushes
}

// worker is one running worker process.
type worker struct {
	set    *procSet
	cmd    *exec.Cmd
	pid    int
	stdin  io.WriteCloser
	dec    *json.Decoder
	killed atomic.Bool

	wmu sync.Mutex // serialises writes to stdin
	enc *json.Encoder

	mu      sync.Mutex
	next    uint64
	pending map[uint64]pendingDelivery
	ended   bool
	dead    chan struct{} // closed once the process has exited and its results are read
}

type pendingDelivery struct {
	id string
	ch chan wireResult
}

func (w *worker) gone() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.ended
}

// apply sends d to the worker and waits for its result, or for the worker
// to die, which leaves the delivery unacknowledged (Killed).
func (w *worker) apply(d Delivery) Result {
	ch := make(chan wireResult, 1)
	w.mu.Lock()
	if w.ended {
		w.mu.Unlock()
		return Result{Outcome: Killed}
	}
	w.next++
	tag := w.next
	w.pending[tag] = pendingDelivery{id: d.MsgID, ch: ch}
	w.mu.Unlock()
	w.wmu.Lock()
	err := w.enc.Encode(wireDelivery{Tag: tag, Seq: d.Seq, ID: d.MsgID, Redelivered: d.Redelivered, Fault: d.Fault})
	w.wmu.Unlock()
	if err != nil {
		<-w.dead
	}
	var r wireResult
	select {
	case r = <-ch:
	case <-w.dead:
		select {
		case r = <-ch:
		default:
			return Result{Outcome: Killed}
		}
	}
	res := Result{Outcome: r.Outcome, TakenOver: r.TakenOver, RetryAfter: r.RetryAfter}
	if r.Err != "" {
		res.Err = errors.New(r.Err)
	}
	return res
}

// read hands each result to its waiting consumer until the worker's
// output ends, then records what was in flight and reaps the process.
func (w *worker) read() {
	for {
		var r wireResult
		if err := w.dec.Decode(&r); err != nil {
			break
		}
		if r.Final {
			w.set.addLayers(r.Layers, r.Flushes)
			continue
		}
		w.mu.Lock()
		p, ok := w.pending[r.Tag]
		delete(w.pending, r.Tag)
		w.mu.Unlock()
		if ok {
			p.ch <- r
		}
	}
	w.cmd.Wait()
	w.mu.Lock()
	w.ended = true
	ids := make(map[string]bool, len(w.pending))
	for _, p := range w.pending {
		ids[p.id] = true
	}
	w.mu.Unlock()
	if len(ids) > 0 {
		w.set.recordDeath(w.pid, ids)
	}
	close(w.dead)
}

// tailBuffer keeps the last few KiB written to it: the workers' stderr,
// quoted when one fails to start.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

const tailSize = 4 << 10

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if len(b.buf) > tailSize {
		b.buf = append(b.buf[:0], b.buf[len(b.buf)-tailSize:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.TrimSpace(string(b.buf))
}
