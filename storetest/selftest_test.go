package storetest

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/brokenstore"
	"github.com/dedupkit/dedup/memstore"
)

// recorder is a testing.TB that records failures instead of reporting
// them, so a test can assert that a check fails against a broken store.
type recorder struct {
	testing.TB
	mu       sync.Mutex
	failed   bool
	first    string
	cleanups []func()
}

func (r *recorder) fail(msg string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.failed {
		r.first = msg
	}
	r.failed = true
}

func (r *recorder) Helper()                      {}
func (r *recorder) Error(args ...any)            { r.fail(fmt.Sprint(args...)) }
func (r *recorder) Errorf(f string, args ...any) { r.fail(fmt.Sprintf(f, args...)) }
func (r *recorder) Fail()                        { r.fail("Fail") }
func (r *recorder) FailNow()                     { r.fail("FailNow"); runtime.Goexit() }
func (r *recorder) Fatal(args ...any)            { r.Error(args...); runtime.Goexit() }
func (r *recorder) Fatalf(f string, args ...any) { r.Errorf(f, args...); runtime.Goexit() }
func (r *recorder) Log(args ...any)              {}
func (r *recorder) Logf(f string, args ...any)   {}
func (r *recorder) Cleanup(f func())             { r.cleanups = append(r.cleanups, f) }
func (r *recorder) Skip(args ...any)             { runtime.Goexit() }
func (r *recorder) Skipf(f string, args ...any)  { runtime.Goexit() }
func (r *recorder) SkipNow()                     { runtime.Goexit() }
func (r *recorder) Failed() bool                 { r.mu.Lock(); defer r.mu.Unlock(); return r.failed }
func (r *recorder) Setenv(key, value string)     { panic("not supported") }
func (r *recorder) Chdir(dir string)             { panic("not supported") }
func (r *recorder) Attr(key, value string)       {}
func (r *recorder) ArtifactDir() string          { return r.TB.TempDir() }
func (r *recorder) Output() io.Writer            { return io.Discard }

// outcomes runs every test against stores made by newStore and returns the
// names of those that failed, with the first message of each.
func outcomes(t *testing.T, newStore NewStore, f Features) map[string]string {
	failed := map[string]string{}
	for _, tc := range Tests {
		if tc.Needs != "" && !f.has(tc.Needs) {
			continue
		}
		r := &recorder{TB: t}
		done := make(chan struct{})
		go func() {
			defer close(done)
			tc.Fn(r, NewEnv(r, newStore, f, tc.Name))
		}()
		<-done
		for i := len(r.cleanups) - 1; i >= 0; i-- {
			r.cleanups[i]()
		}
		if r.failed {
			failed[tc.Name] = r.first
		}
	}
	return failed
}

// TestSuiteCatchesBrokenStores proves that the suite can fail: each broken
// design must fail the checks that describe its flaw, and the reference
// store must fail none.
func TestSuiteCatchesBrokenStores(t *testing.T) {
	cases := []struct {
		name     string
		newStore NewStore
		f        Features
		mustFail []string
	}{
		{
			name: "check-then-set",
			newStore: func(t testing.TB, _ *Clock) dedup.Store {
				// A millisecond between the check and the write: with
				// only a yield there, a loaded machine (CI under -race)
				// can run the suite's concurrent claims one after another
				// and let this store pass ConcurrentClaimOneKey.
				return brokenstore.NewCheckThenSet().WithWindow(time.Millisecond)
			},
			mustFail: []string{"ConcurrentClaimOneKey", "ConcurrentRunOnce"},
		},
		{
			name: "mark-first (SET NX, then process)",
			newStore: func(t testing.TB, _ *Clock) dedup.Store {
				return brokenstore.NewMarkFirst()
			},
			mustFail: []string{"FailedRunIsNotLost", "ReleaseThenReclaim", "LiveLeaseIsInProgress", "SequentialDuplicate"},
		},
		{
			name: "batch completion that stops at the first failure",
			newStore: func(t testing.TB, c *Clock) dedup.Store {
				s, err := memstore.New(memstore.WithClock(c))
				if err != nil {
					t.Fatal(err)
				}
				return stopsAtFirst{s}
			},
			f:        Features{ManualClock: true, BatchComplete: true},
			mustFail: []string{"BatchComplete"},
		},
		{
			name: "memstore (reference)",
			newStore: func(t testing.TB, c *Clock) dedup.Store {
				s, err := memstore.New(memstore.WithClock(c))
				if err != nil {
					t.Fatal(err)
				}
				return s
			},
			f: Features{ManualClock: true, Extend: true, BatchClaim: true, BatchComplete: true, Sweep: true},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			failed := outcomes(t, tc.newStore, tc.f)
			for _, name := range tc.mustFail {
				if _, ok := failed[name]; !ok {
					t.Errorf("the suite's %s passed against the broken %s store", name, tc.name)
				}
			}
			if len(tc.mustFail) == 0 && len(failed) > 0 {
				t.Errorf("the reference store failed: %v", failed)
			}
			for name, msg := range failed {
				t.Logf("%s failed as expected: %s", name, msg)
			}
		})
	}
}

// stopsAtFirst completes a batch item by item and gives up at the first
// error, reporting it for the whole call: a fenced-out item then hides
// the outcome of the others, and an invalid item is found only after the
// items before it were written.
type stopsAtFirst struct{ *memstore.Store }

func (s stopsAtFirst) CompleteBatch(ctx context.Context, items []dedup.Completion, ret time.Duration) ([]error, error) {
	for _, it := range items {
		if err := s.Complete(ctx, it.Claim, it.Result, ret); err != nil {
			return nil, err
		}
	}
	return make([]error, len(items)), nil
}
