package verify_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/brokenstore"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/internal/verify"
)

// open opens a backend by name in its default mode, closing it at the end
// of the test.
func open(t *testing.T, store string, mode verify.Mode, cfg verify.Config) verify.Target {
	t.Helper()
	b, ok := verify.LookupBackend(store)
	if !ok {
		t.Fatalf("no backend %q", store)
	}
	if mode == "" {
		mode = b.Modes[0]
	}
	o := verify.OpenOptions{Mode: mode, Lease: cfg.Lease, Messages: cfg.Messages}
	if store == "layered" {
		o.FlushEvery = 300 // FLUSHALL and an empty window every 300 deliveries
	}
	if b.UsesPath {
		o.Path = filepath.Join(t.TempDir(), "verify.db")
	}
	tg, err := b.Open(t.Context(), o)
	if err != nil {
		t.Fatalf("open %s: %v", store, err)
	}
	t.Cleanup(func() {
		if err := tg.Close(); err != nil {
			t.Errorf("close %s: %v", store, err)
		}
	})
	return tg
}

func run(t *testing.T, cfg verify.Config, tg verify.Target) verify.Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	rep, err := verify.Run(ctx, cfg, tg)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("%s/%s: %d messages, %d deliveries, %d effects, %d duplicates skipped, crashes %d before + %d after commit, %d takeovers, %d handler failures, %d in-progress nacks, %d store errors, lost %d, double %d, slowest delivery %.0fms, %.2fs",
		rep.Store, rep.Mode, rep.Messages, rep.Deliveries, rep.Effects, rep.DuplicatesSkipped,
		rep.CrashesBeforeCommit, rep.CrashesAfterCommit, rep.Takeovers, rep.HandlerFailures,
		rep.InProgressNacks, rep.StoreErrors, rep.Lost, rep.DoubleApplied, rep.SlowestDeliveryMS, rep.Seconds)
	return rep
}

// requireExactlyOnce fails unless every message was applied exactly once
// and the faults of cfg were really exercised.
func requireExactlyOnce(t *testing.T, cfg verify.Config, rep verify.Report) {
	t.Helper()
	if !rep.OK || rep.Lost != 0 || rep.DoubleApplied != 0 || rep.Unfinished != 0 {
		t.Fatalf("want exactly once, got ok=%v lost=%d (%v) double=%d (%v) unfinished=%d first error %q",
			rep.OK, rep.Lost, rep.LostSample, rep.DoubleApplied, rep.DoubleSample, rep.Unfinished, rep.FirstError)
	}
	if rep.Effects != cfg.Messages {
		t.Fatalf("effects = %d, want %d", rep.Effects, cfg.Messages)
	}
	if rep.Deliveries < cfg.Messages+rep.BrokerDuplicates {
		t.Fatalf("deliveries = %d, fewer than messages %d + copies %d", rep.Deliveries, cfg.Messages, rep.BrokerDuplicates)
	}
	if rep.DuplicatesSkipped < rep.CrashesAfterCommit {
		t.Errorf("duplicates skipped %d < crashes after commit %d: each such crash must be redelivered as a duplicate", rep.DuplicatesSkipped, rep.CrashesAfterCommit)
	}
	// With these rates and message counts, every fault fires (the chance
	// that one does not is far below 1e-9).
	checks := []struct {
		name string
		rate float64
		got  int
	}{
		{"broker duplicates", cfg.DupRate, rep.BrokerDuplicates},
		{"duplicates skipped", cfg.DupRate, rep.DuplicatesSkipped},
		{"crashes before commit", cfg.CrashRate, rep.CrashesBeforeCommit},
		{"crashes after commit", cfg.CrashRate, rep.CrashesAfterCommit},
		{"handler failures", cfg.FailRate, rep.HandlerFailures},
	}
	if rep.Mode == verify.LeaseMode {
		// A consumer that crashed holding the claim is only recovered by
		// a take-over after its lease expires.
		checks = append(checks, struct {
			name string
			rate float64
			got  int
		}{"takeovers", cfg.CrashRate, rep.Takeovers})
	}
	for _, c := range checks {
		if c.rate > 0 && c.got == 0 {
			t.Errorf("%s = 0 at rate %v: the fault was not exercised", c.name, c.rate)
		}
	}
	// Each consumer that crashed holding a claim is taken over exactly
	// once; any other take-over replaced an owner that was still working.
	// With processes killed, a claim held by a killed process is taken
	// over too.
	if rep.Mode == verify.LeaseMode && rep.LeasesLost == 0 && rep.Processes == 0 && rep.Takeovers != rep.CrashesBeforeCommit {
		t.Errorf("takeovers %d != crashes before commit %d", rep.Takeovers, rep.CrashesBeforeCommit)
	}
	if rep.Mode == verify.LeaseMode && rep.LeasesLost == 0 && rep.Processes > 0 &&
		(rep.Takeovers < rep.CrashesBeforeCommit || rep.Takeovers > rep.CrashesBeforeCommit+rep.KilledDeliveries) {
		t.Errorf("takeovers %d outside crashes before commit %d + deliveries killed in flight %d", rep.Takeovers, rep.CrashesBeforeCommit, rep.KilledDeliveries)
	}
	// A plain inbox holds no leases. A layered one holds a short lease in
	// its fast store while the transaction runs, so it may nack.
	if rep.Mode.Transactional() && len(rep.Layers) == 0 && rep.Takeovers+rep.InProgressNacks != 0 {
		t.Errorf("inbox mode saw %d takeovers and %d in-progress nacks; it holds no leases", rep.Takeovers, rep.InProgressNacks)
	}
}

func smallConfig() verify.Config {
	cfg := verify.DefaultConfig()
	cfg.Messages = 500
	cfg.DupRate = 0.3
	cfg.CrashRate = 0.06
	cfg.FailRate = 0.04
	// Longer than the default, so that a consumer stalled by the race
	// detector on a busy machine is not taken over while it works (the
	// lease-mode window that verify reports but cannot close).
	cfg.Lease = 500 * time.Millisecond
	cfg.Seed = 1
	return cfg
}

// sqliteLeaseConfig gives SQLite in lease mode a lease far above its
// slowest claim-to-complete time: writers queue on SQLite's one write lock,
// and its busy handler lets a waiter sleep while others go first, so under
// the race detector one delivery can take over half a second. A shorter
// lease would be taken over mid-work and apply the effect twice, which
// verify would rightly report.
func sqliteLeaseConfig() verify.Config {
	cfg := smallConfig()
	cfg.Consumers = 4
	cfg.Lease = 3 * time.Second
	return cfg
}

func stressConfig() verify.Config {
	cfg := smallConfig()
	cfg.Messages = 1000
	cfg.Consumers = 32
	cfg.DupRate = 0.5
	cfg.CrashRate = 0.05
	cfg.FailRate = 0.02
	cfg.Seed = 2
	return cfg
}

func TestExactlyOnce(t *testing.T) {
	for _, tc := range []struct {
		name  string
		store string
		mode  verify.Mode
		cfg   verify.Config
	}{
		{"memory/defaults", "memory", "", smallConfig()},
		{"sqlite-inbox/defaults", "sqlite", verify.InboxMode, smallConfig()},
		{"sqlite-lease/defaults", "sqlite", verify.LeaseMode, sqliteLeaseConfig()},
		{"memory/stress", "memory", "", stressConfig()},
		{"sqlite-inbox/stress", "sqlite", verify.InboxMode, stressConfig()},
		{"redis/stress", "redis", "", stressConfig()},
		{"layered-with-redis-flushes/stress", "layered", "", stressConfig()},
		{"postgres-inbox/stress", "postgres", verify.InboxMode, stressConfig()},
		{"postgres-apply/stress", "postgres", verify.ApplyMode, stressConfig()},
		{"postgres-lease/defaults", "postgres", verify.LeaseMode, postgresLeaseConfig()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if tc.store == "redis" || tc.store == "layered" {
				testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
			}
			if tc.store == "postgres" {
				testenv.PostgresURL(t)
			}
			tg := open(t, tc.store, tc.mode, tc.cfg)
			rep := run(t, tc.cfg, tg)
			if rep.Store != tc.store {
				t.Errorf("store = %q, want %q", rep.Store, tc.store)
			}
			requireExactlyOnce(t, tc.cfg, rep)
			if tc.store == "layered" && (rep.Flushes == 0 || rep.Layers["durable"] == 0 || rep.Layers["window"]+rep.Layers["redis"] == 0) {
				t.Errorf("layered run: %d flushes, caught %v; want flushes, and duplicates caught by the durable store and by the faster layers", rep.Flushes, rep.Layers)
			}
		})
	}
}

// TestCheckThenSetDoublesEffects proves that verify catches a store whose
// claim is not atomic: adjacent copies race and both acquire.
func TestCheckThenSetDoublesEffects(t *testing.T) {
	t.Parallel()
	cfg := verify.DefaultConfig()
	cfg.Messages = 2000
	cfg.Consumers = 32
	cfg.DupRate = 1
	cfg.CrashRate = 0
	cfg.FailRate = 0
	cfg.Seed = 3
	tg, err := verify.NewLease("check-then-set", brokenstore.NewCheckThenSet().WithWindow(time.Millisecond), cfg.Lease)
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	rep := run(t, cfg, tg)
	if rep.DoubleApplied == 0 || rep.OK {
		t.Fatalf("check-then-set store passed: double applied %d, ok %v", rep.DoubleApplied, rep.OK)
	}
	if len(rep.DoubleSample) == 0 {
		t.Error("no sample of double-applied messages")
	}
}

// TestMarkFirstLosesMessages proves that verify catches "SET NX, then
// process": a failed handler's redelivery is skipped as a duplicate.
func TestMarkFirstLosesMessages(t *testing.T) {
	t.Parallel()
	cfg := verify.DefaultConfig()
	cfg.Messages = 1000
	cfg.DupRate = 0
	cfg.CrashRate = 0
	cfg.FailRate = 0.2
	cfg.Seed = 4
	tg, err := verify.NewLease("mark-first", brokenstore.NewMarkFirst(), cfg.Lease)
	if err != nil {
		t.Fatal(err)
	}
	defer tg.Close()
	rep := run(t, cfg, tg)
	if rep.Lost == 0 || rep.OK {
		t.Fatalf("mark-first store passed: lost %d, ok %v", rep.Lost, rep.OK)
	}
	// Without copies or crashes every first delivery acquires, so each
	// handler failure loses its message.
	if rep.Lost != rep.HandlerFailures {
		t.Errorf("lost = %d, want one per handler failure (%d)", rep.Lost, rep.HandlerFailures)
	}
	if rep.Effects+rep.Lost != cfg.Messages {
		t.Errorf("effects %d + lost %d != messages %d", rep.Effects, rep.Lost, cfg.Messages)
	}
}

// stuckStore reports every key as in progress, forever.
type stuckStore struct{ dedup.Store }

func (stuckStore) Claim(_ context.Context, key dedup.Key, _ dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	return dedup.Claim{Key: key, Outcome: dedup.InProgress, Attempt: 1, LeaseUntil: time.Now().Add(lease)}, nil
}
func (stuckStore) Close() error { return nil }

func TestTimeoutFails(t *testing.T) {
	t.Parallel()
	cfg := verify.DefaultConfig()
	cfg.Messages = 50
	cfg.Lease = 20 * time.Millisecond
	tg, err := verify.NewLease("stuck", stuckStore{}, cfg.Lease)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	// The report says the timeout ended the run (every message left
	// unfinished); no wall-clock bound: a Run that ignored ctx would hang
	// on the stuck store until the test binary's timeout.
	rep, err := verify.Run(ctx, cfg, tg)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.TimedOut || rep.OK || rep.Unfinished != cfg.Messages || rep.InProgressNacks == 0 {
		t.Fatalf("timed out %v, ok %v, unfinished %d, in-progress nacks %d", rep.TimedOut, rep.OK, rep.Unfinished, rep.InProgressNacks)
	}
	if rep.Lost != 0 {
		t.Errorf("lost = %d; unacknowledged messages are unfinished, not lost", rep.Lost)
	}
	if v := strings.Join(rep.Violations(), "; "); !strings.Contains(v, "timed out") {
		t.Errorf("violations %q do not mention the timeout", v)
	}
}

// failingStore fails every claim like an unreachable server.
type failingStore struct{ stuckStore }

func (failingStore) Claim(context.Context, dedup.Key, dedup.Fingerprint, time.Duration) (dedup.Claim, error) {
	return dedup.Claim{}, &dedup.StoreError{Store: "down", Op: "claim", Err: errors.New("connection refused"), NotApplied: true}
}

func TestStoreErrorsFailClosed(t *testing.T) {
	t.Parallel()
	cfg := verify.DefaultConfig()
	cfg.Messages = 20
	cfg.Lease = 20 * time.Millisecond
	tg, err := verify.NewLease("down", failingStore{}, cfg.Lease)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	rep, err := verify.Run(ctx, cfg, tg)
	if err != nil {
		t.Fatal(err)
	}
	if rep.StoreErrors == 0 || rep.DuplicatesSkipped != 0 || rep.Effects != 0 || rep.OK {
		t.Fatalf("store errors %d, duplicates %d, effects %d, ok %v: a failing store must be retried, never skipped", rep.StoreErrors, rep.DuplicatesSkipped, rep.Effects, rep.OK)
	}
	if !strings.Contains(rep.FirstError, "connection refused") {
		t.Errorf("first error %q does not carry the cause", rep.FirstError)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		flag string
		edit func(*verify.Config)
	}{
		{"--messages", func(c *verify.Config) { c.Messages = 0 }},
		{"--consumers", func(c *verify.Config) { c.Consumers = 0 }},
		{"--dup-rate", func(c *verify.Config) { c.DupRate = 1.5 }},
		{"--crash-rate", func(c *verify.Config) { c.CrashRate = -0.1 }},
		{"--fail-rate", func(c *verify.Config) { c.FailRate = 2 }},
		{"--crash-rate plus --fail-rate", func(c *verify.Config) { c.CrashRate, c.FailRate = 0.5, 0.5 }},
		{"--lease", func(c *verify.Config) { c.Lease = 0 }},
	} {
		cfg := verify.DefaultConfig()
		tc.edit(&cfg)
		err := cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("%s: Validate() = %v, want an error naming %s", tc.flag, err, tc.flag)
		}
	}
	cfg := verify.DefaultConfig()
	if err := cfg.Validate(); err != nil {
		t.Errorf("DefaultConfig: %v", err)
	}
}

func TestTemporaryDatabaseRemoved(t *testing.T) {
	t.Parallel()
	for _, keep := range []bool{false, true} {
		b, _ := verify.LookupBackend("sqlite")
		tg, err := b.Open(t.Context(), verify.OpenOptions{Mode: verify.InboxMode, Keep: keep, Lease: time.Second, Messages: 10})
		if err != nil {
			t.Fatal(err)
		}
		path := verify.PathOf(tg)
		if path == "" {
			t.Fatal("no path for a temporary database")
		}
		if err := tg.Close(); err != nil {
			t.Fatal(err)
		}
		_, err = os.Stat(path)
		if keep {
			if err != nil {
				t.Errorf("--keep: %v", err)
			}
			os.RemoveAll(filepath.Dir(path))
		} else if !os.IsNotExist(err) {
			t.Errorf("temporary database %s not removed: %v", path, err)
		}
	}
}
