package redisstore

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/redis/rueidis"
)

// privateStore opens a store on a redis-server of the test's own, so that
// INFO commandstats counts only this test's commands.
func privateStore(t *testing.T) *Store {
	t.Helper()
	srv := testenv.StartRedis(t, "")
	s, err := Open(rueidis.ClientOption{InitAddress: srv.Addrs()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// scriptCalls is how many EVALSHA and EVAL calls the server ran since the
// last CONFIG RESETSTAT.
func scriptCalls(t *testing.T, s *Store) int {
	t.Helper()
	v, err := s.client.Do(context.Background(), s.client.B().Info().Section("commandstats").Build()).ToString()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(v, "\r\n") {
		if !strings.HasPrefix(line, "cmdstat_evalsha:") && !strings.HasPrefix(line, "cmdstat_eval:") {
			continue
		}
		_, rest, _ := strings.Cut(line, "calls=")
		c, _ := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
		n += c
	}
	return n
}

// fillSlots takes every flush slot, so that completions queue; the
// returned function gives them back.
func fillSlots(s *Store) func() {
	for range maxFlushes {
		s.coalesce.sem <- struct{}{}
	}
	return func() {
		for range maxFlushes {
			<-s.coalesce.sem
		}
	}
}

// queued is how many items the filling batch holds.
func queued(s *Store) int {
	s.coalesce.mu.Lock()
	defer s.coalesce.mu.Unlock()
	if s.coalesce.cur == nil {
		return 0
	}
	return len(s.coalesce.cur.items)
}

func waitQueued(t *testing.T, s *Store, n int) {
	t.Helper()
	for i := 0; queued(s) < n; i++ {
		if i == 10000 {
			t.Fatalf("%d completions queued, want %d", queued(s), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestCompleteCoalesced: completions that queue while every flush slot is
// busy go to the server as one script call, and each caller still gets
// its own key's answer: a live token completes, a stale one (taken over)
// is lease lost and changes nothing, the same claim completed twice
// completes once, and items with another retention are sent beside them.
func TestCompleteCoalesced(t *testing.T) {
	s := privateStore(t)
	ctx := context.Background()
	fp := dedup.FingerprintOf([]byte("p"))
	const n = 40
	claims := make([]dedup.Claim, n)
	for i := range claims {
		c, err := s.Claim(ctx, dedup.Key{Scope: "co", ID: strconv.Itoa(i)}, fp, time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim %d: %v %v", i, c.Outcome, err)
		}
		claims[i] = c
	}
	// Key 0's lease is taken over (by a short lease that expired): the
	// first claim's token is dead.
	stale, err := s.Claim(ctx, dedup.Key{Scope: "co", ID: "stale"}, fp, time.Millisecond)
	if err != nil || stale.Outcome != dedup.Acquired {
		t.Fatal(stale.Outcome, err)
	}
	time.Sleep(5 * time.Millisecond)
	if c, err := s.Claim(ctx, stale.Key, fp, time.Minute); err != nil || c.Outcome != dedup.Acquired || !c.TakenOver {
		t.Fatalf("take-over: %+v %v", c, err)
	}
	// Load the script, so that no NOSCRIPT reply adds a call below.
	if err := s.client.Do(ctx, s.client.B().ScriptLoad().Script(completeManyScript).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	if err := s.client.Do(ctx, s.client.B().ConfigResetstat().Build()).Error(); err != nil {
		t.Fatal(err)
	}

	release := fillSlots(s)
	type job struct {
		c   dedup.Claim
		res string
		ret time.Duration
	}
	jobs := []job{{c: stale, res: "stale", ret: time.Hour}, {c: claims[1], res: "again", ret: time.Hour}}
	for i, c := range claims {
		ret := time.Hour
		if i%10 == 9 {
			ret = 2 * time.Hour
		}
		jobs = append(jobs, job{c: c, res: "r" + strconv.Itoa(i), ret: ret})
	}
	errs := make([]error, len(jobs))
	var wg sync.WaitGroup
	for i, j := range jobs {
		wg.Go(func() { errs[i] = s.Complete(ctx, j.c, []byte(j.res), j.ret) })
		if i == 1 {
			// The second completion of claims[1] goes first in the batch.
			waitQueued(t, s, 2)
		}
	}
	waitQueued(t, s, len(jobs))
	release()
	wg.Wait()

	if !errors.Is(errs[0], dedup.ErrLeaseLost) {
		t.Fatalf("stale token: %v, want lease lost", errs[0])
	}
	for i, err := range errs[1:] {
		if err != nil {
			t.Fatalf("completion %d: %v", i+1, err)
		}
	}
	// One batch, two retentions: two script calls in one flush (the
	// repeated claims[1] is sent once and its second item answered as
	// its first).
	if got := scriptCalls(t, s); got != 2 {
		t.Fatalf("%d script calls for %d queued completions, want 2 (one a retention)", got, len(jobs))
	}
	for i, c := range claims {
		d, err := s.Claim(ctx, c.Key, fp, time.Minute)
		if err != nil || d.Outcome != dedup.Duplicate {
			t.Fatalf("key %d after: %v %v", i, d.Outcome, err)
		}
		want := "r" + strconv.Itoa(i)
		if i == 1 {
			want = "again" // completed first; the later item changed nothing
		}
		if string(d.Result) != want {
			t.Fatalf("key %d result %q, want %q", i, d.Result, want)
		}
		wantExp := time.Hour
		if i%10 == 9 {
			wantExp = 2 * time.Hour
		}
		if left := time.Until(d.ExpiresAt); left < wantExp-time.Minute || left > wantExp {
			t.Fatalf("key %d expires in %v, want about %v", i, left, wantExp)
		}
	}
	if c, err := s.Claim(ctx, stale.Key, fp, time.Minute); err != nil || c.Outcome != dedup.InProgress {
		t.Fatalf("the taken-over key after a stale completion: %v %v, want still in progress", c.Outcome, err)
	}
}

// TestCompleteCoalescedCancelled: a caller whose context ends while its
// completion is queued gets a not-applied store error and its record is
// left in progress, while the others queued with it complete.
func TestCompleteCoalescedCancelled(t *testing.T) {
	s := privateStore(t)
	ctx := context.Background()
	fp := dedup.FingerprintOf([]byte("p"))
	var claims [3]dedup.Claim
	for i := range claims {
		c, err := s.Claim(ctx, dedup.Key{Scope: "cancel", ID: strconv.Itoa(i)}, fp, time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatal(c.Outcome, err)
		}
		claims[i] = c
	}
	release := fillSlots(s)
	cctx, cancel := context.WithCancel(ctx)
	errs := make([]error, len(claims))
	var wg sync.WaitGroup
	for i, c := range claims {
		cx := ctx
		if i == 1 {
			cx = cctx
		}
		wg.Go(func() { errs[i] = s.Complete(cx, c, []byte("r"), time.Hour) })
		waitQueued(t, s, i+1)
	}
	cancel()
	for i := 0; ; i++ {
		s.coalesce.mu.Lock()
		d := s.coalesce.cur.dropped[1]
		s.coalesce.mu.Unlock()
		if d {
			break
		}
		if i == 10000 {
			t.Fatal("the cancelled completion was not dropped")
		}
		time.Sleep(time.Millisecond)
	}
	release()
	wg.Wait()
	var se *dedup.StoreError
	if !errors.As(errs[1], &se) || !se.NotApplied || !errors.Is(errs[1], context.Canceled) {
		t.Fatalf("cancelled completion: %v, want a not-applied store error wrapping context.Canceled", errs[1])
	}
	for _, i := range []int{0, 2} {
		if errs[i] != nil {
			t.Fatalf("completion %d: %v", i, errs[i])
		}
		if d, err := s.Claim(ctx, claims[i].Key, fp, time.Minute); err != nil || d.Outcome != dedup.Duplicate {
			t.Fatalf("key %d: %v %v, want duplicate", i, d.Outcome, err)
		}
	}
	if d, err := s.Claim(ctx, claims[1].Key, fp, time.Minute); err != nil || d.Outcome != dedup.InProgress {
		t.Fatalf("the dropped key: %v %v, want still in progress", d.Outcome, err)
	}
}
