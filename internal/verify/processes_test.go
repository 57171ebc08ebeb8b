package verify_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/internal/verify"
)

// TestMain lets the test binary serve as a worker process of RunProcesses,
// as `dedup verify` does.
func TestMain(m *testing.M) {
	if code, ok := verify.WorkerMain(os.Stdin, os.Stdout, os.Stderr); ok {
		os.Exit(code)
	}
	os.Exit(m.Run())
}

func processConfig() verify.Config {
	cfg := smallConfig()
	cfg.Messages = 600
	cfg.Consumers = 4
	cfg.Seed = 21
	return cfg
}

// runProcesses runs cfg over store in separate worker processes (this test
// binary), killing one every killEvery deliveries.
func runProcesses(t *testing.T, store string, mode verify.Mode, cfg verify.Config, o verify.OpenOptions, po verify.ProcessOptions) verify.Report {
	t.Helper()
	b, ok := verify.LookupBackend(store)
	if !ok {
		t.Fatalf("no backend %q", store)
	}
	o.Mode, o.Lease, o.Messages = mode, cfg.Lease, cfg.Messages
	ctx, cancel := testContext(t, 2*time.Minute)
	defer cancel()
	rep, err := verify.RunProcesses(ctx, cfg, b, o, po)
	if err != nil {
		t.Fatalf("RunProcesses: %v", err)
	}
	t.Logf("%s/%s: %d processes (%d started, %d killed, %d deliveries killed in flight), %d deliveries, %d effects, %d duplicates skipped, %d takeovers, lost %d, double %d (%d in the kill window), %.2fs",
		rep.Store, rep.Mode, rep.Processes, rep.ProcessStarts, rep.ProcessKills, rep.KilledDeliveries, rep.Deliveries, rep.Effects,
		rep.DuplicatesSkipped, rep.Takeovers, rep.Lost, rep.DoubleApplied, rep.KillWindowDoubles, rep.Seconds)
	return rep
}

// Consumers in separate processes on one store, whole processes SIGKILLed
// mid-run and restarted: every message takes effect exactly once, judged
// from the shared ledger (the inbox's SQL table, or lease mode's file).
func TestProcessesExactlyOnce(t *testing.T) {
	for _, tc := range []struct {
		name  string
		store string
		mode  verify.Mode
		lease time.Duration
	}{
		{"sqlite-inbox", "sqlite", verify.InboxMode, 0},
		{"sqlite-lease", "sqlite", verify.LeaseMode, 3 * time.Second},
		{"postgres-inbox", "postgres", verify.InboxMode, 0},
		{"postgres-apply", "postgres", verify.ApplyMode, 0},
		{"redis-lease", "redis", verify.LeaseMode, 0},
		{"layered", "layered", verify.InboxMode, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			switch tc.store {
			case "redis", "layered":
				testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
			case "postgres":
				testenv.PostgresURL(t)
			}
			cfg := processConfig()
			if tc.lease > 0 {
				cfg.Lease = tc.lease
			}
			var o verify.OpenOptions
			if tc.store == "layered" {
				o.FlushEvery = 150
			}
			po := verify.ProcessOptions{Processes: 2, KillEvery: 120}
			rep := runProcesses(t, tc.store, tc.mode, cfg, o, po)
			if rep.Processes != 2 || rep.ProcessKills == 0 || rep.KilledDeliveries == 0 {
				t.Fatalf("processes %d, kills %d, deliveries killed in flight %d: the kills were not exercised", rep.Processes, rep.ProcessKills, rep.KilledDeliveries)
			}
			if rep.ProcessStarts < 2 || rep.ProcessStarts > 2+rep.ProcessKills {
				t.Errorf("%d processes started for 2 slots and %d kills", rep.ProcessStarts, rep.ProcessKills)
			}
			if tc.mode == verify.LeaseMode && rep.DoubleApplied > 0 {
				// Lease mode's open window: a process killed after its
				// effect and before Complete. Anything else is a bug.
				if rep.DoubleApplied != rep.KillWindowDoubles || rep.Lost != 0 {
					t.Fatalf("lease mode: %d doubles, only %d explained by a kill in the effect-to-Complete window; lost %d", rep.DoubleApplied, rep.KillWindowDoubles, rep.Lost)
				}
				t.Logf("lease mode's open window hit: %d messages applied twice by a killed process and the take-over", rep.DoubleApplied)
				return
			}
			requireExactlyOnce(t, cfg, rep)
		})
	}
}

func TestProcessesRefuses(t *testing.T) {
	t.Parallel()
	cfg := processConfig()
	mem, _ := verify.LookupBackend("memory")
	sq, _ := verify.LookupBackend("sqlite")
	for _, tc := range []struct {
		name string
		b    verify.Backend
		po   verify.ProcessOptions
		want string
	}{
		{"memory", mem, verify.ProcessOptions{Processes: 2}, "memory store"},
		{"no processes", sq, verify.ProcessOptions{}, "--processes"},
		{"too many", sq, verify.ProcessOptions{Processes: verify.MaxProcesses + 1}, "--processes"},
		{"negative kill-every", sq, verify.ProcessOptions{Processes: 1, KillEvery: -1}, "--kill-every"},
	} {
		_, err := verify.RunProcesses(t.Context(), cfg, tc.b, verify.OpenOptions{Lease: cfg.Lease, Messages: cfg.Messages}, tc.po)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want one naming %q", tc.name, err, tc.want)
		}
	}
}

// A worker command that never becomes a worker ends the run with an error
// that says so, instead of retrying forever.
func TestProcessesWorkerThatCannotStart(t *testing.T) {
	t.Parallel()
	cfg := processConfig()
	cfg.Messages = 10
	sq, _ := verify.LookupBackend("sqlite")
	o := verify.OpenOptions{Lease: cfg.Lease, Messages: cfg.Messages, Path: filepath.Join(t.TempDir(), "v.db")}
	ctx, cancel := testContext(t, time.Minute)
	defer cancel()
	_, err := verify.RunProcesses(ctx, cfg, sq, o, verify.ProcessOptions{Processes: 2, Command: []string{"/bin/sh", "-c", "echo nope >&2; exit 3"}})
	if err == nil || !strings.Contains(err.Error(), "failed to start") || !strings.Contains(err.Error(), "nope") {
		t.Fatalf("err = %v, want the start failure with the worker's stderr", err)
	}
}

func testContext(t *testing.T, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(t.Context(), d)
}
