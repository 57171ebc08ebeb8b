package dedupwatermill_test

import (
	"runtime"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/dedupwatermill"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/window"
)

// BenchmarkHeld is the memory a deduplicator holds per message it has
// seen, at steady state: 100,000 new messages with real 36-character UUIDs
// go through the middleware and are acked, their completions land, and
// the heap is read after two GCs, before and after. held-B/msg is the
// growth per message: the key string (every design keeps it), the table
// entry and whatever the design keeps beside the key. It is what a
// retention of a day at a given rate costs in memory; B/op of
// BenchmarkMiddleware is the garbage a message makes on its way through.
//
//   - watermill-uuid: Watermill's Deduplicator keyed on the UUID (a map of
//     UUID to time.Time);
//   - ours-memstore: this package on memstore (token, SHA-256 fingerprint,
//     lease and expiry per key: what a claim that can be released or taken
//     over needs);
//   - ours-window: on a window in front of memstore (both hold the key);
//   - window-alone: a window's Add of the same keys, not a middleware (the
//     window is not a store: it holds 128-bit hashes of completed keys
//     and nothing a claim needs).
//
// Run with -benchtime 1x; the rounds rotate the cases.
func BenchmarkHeld(b *testing.B) {
	const n = 100_000
	// A case builds its deduplicator and returns the middleware, a test
	// of whether all n completions landed, and what to keep alive.
	cases := []struct {
		name  string
		build func(b *testing.B) (message.HandlerMiddleware, func() bool, any)
	}{
		{"watermill-uuid", func(b *testing.B) (message.HandlerMiddleware, func() bool, any) {
			d := &middleware.Deduplicator{KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil }}
			return d.Middleware, func() bool { return true }, d
		}},
		{"ours-memstore", func(b *testing.B) (message.HandlerMiddleware, func() bool, any) {
			s, err := memstore.New()
			if err != nil {
				b.Fatal(err)
			}
			mw, err := dedupwatermill.New(s, "bench")
			if err != nil {
				b.Fatal(err)
			}
			return mw.Middleware, func() bool { return mw.Stats().Completed == n }, []any{s, mw}
		}},
		{"ours-window", func(b *testing.B) (message.HandlerMiddleware, func() bool, any) {
			ms, err := memstore.New()
			if err != nil {
				b.Fatal(err)
			}
			w, err := window.New(window.WithCapacity(1 << 20))
			if err != nil {
				b.Fatal(err)
			}
			s, err := layered.New(layered.WithWindow(w), layered.WithDurable(ms, "memstore"))
			if err != nil {
				b.Fatal(err)
			}
			mw, err := dedupwatermill.New(s, "bench")
			if err != nil {
				b.Fatal(err)
			}
			return mw.Middleware, func() bool { return mw.Stats().Completed == n }, []any{ms, w, s, mw}
		}},
		{"window-alone", func(b *testing.B) (message.HandlerMiddleware, func() bool, any) {
			w, err := window.New(window.WithCapacity(1 << 20))
			if err != nil {
				b.Fatal(err)
			}
			// Not a middleware: each message's key is added as completed.
			exp := time.Now().Add(time.Hour)
			add := func(h message.HandlerFunc) message.HandlerFunc {
				return func(m *message.Message) ([]*message.Message, error) {
					w.Add(dedup.Key{Scope: "bench", ID: m.UUID}, nil, exp)
					return h(m)
				}
			}
			return add, func() bool { return true }, w
		}},
	}
	handler := func(*message.Message) ([]*message.Message, error) { return nil, nil }
	for range benchRounds {
		for _, c := range cases {
			b.Run(c.name, func(b *testing.B) {
				for b.Loop() {
					mw, done, keep := c.build(b)
					h := mw(handler)
					before := heapAfterGC()
					for i := range n {
						m := message.NewMessage(watermill.NewUUID(), payload(i))
						if _, err := h(m); err != nil {
							b.Fatal(err)
						}
						m.Ack()
					}
					for !done() {
						time.Sleep(time.Millisecond)
					}
					after := heapAfterGC()
					runtime.KeepAlive(keep)
					b.ReportMetric(float64(int64(after)-int64(before))/n, "held-B/msg")
				}
			})
		}
	}
}

func heapAfterGC() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}
