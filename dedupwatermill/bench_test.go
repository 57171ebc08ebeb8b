package dedupwatermill_test

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/dedupwatermill"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/window"
	"github.com/redis/rueidis"
)

var sinkFP dedup.Fingerprint

// payload is a JSON-like body that differs from its neighbours only in a
// sequential id, as orders, payments and events do.
func payload(i int) []byte {
	return []byte(`{"order_id":` + strconv.Itoa(i) + `,"customer":"c-42","amount":1999,"currency":"EUR","status":"placed"}`)
}

// BenchmarkMiddleware is the per-message cost of deduplication in a
// Watermill handler chain, every message new (the common case), with the
// router's part simulated: the wrapped handler is called and the message
// acked. Cases, in one run (go test -count rotates them):
//
//   - plain: no middleware (the floor: message creation and the call);
//   - floor-sha256: plain plus the SHA-256 fingerprint of the payload;
//   - floor-map: plain plus a mutex map insert of the UUID, never undone;
//   - watermill-default: Watermill's Deduplicator with its defaults
//     (Adler-32 of the payload as the key, an in-memory map);
//   - watermill-uuid: the same keyed on the message UUID;
//   - ours-memstore: this package on memstore;
//   - ours-memstore-steady: the same on a memstore at its steady size
//     (records expire as they are completed; "new" only);
//   - ours-window: this package on a window in front of memstore
//     (layered).
//
// "new" sends distinct messages; "dup" redelivers 1024 messages already
// processed. lost/op is the fraction of distinct messages whose handler
// never ran (Watermill's default key collides on these payloads);
// reruns/op the fraction of redeliveries that ran the handler again;
// cpu-ns/op the process's CPU time per message (steadier than wall time
// on a shared machine).
func BenchmarkMiddleware(b *testing.B) {
	cases := []struct {
		name string
		mw   func(b *testing.B) message.HandlerMiddleware
	}{
		{"plain", func(*testing.B) message.HandlerMiddleware {
			return func(h message.HandlerFunc) message.HandlerFunc { return h }
		}},
		{"floor-sha256", func(*testing.B) message.HandlerMiddleware {
			// What any middleware that fingerprints the payload pays at
			// least: the SHA-256 of the payload, nothing stored.
			return func(h message.HandlerFunc) message.HandlerFunc {
				return func(m *message.Message) ([]*message.Message, error) {
					sinkFP = dedup.FingerprintOf(m.Payload)
					return h(m)
				}
			}
		}},
		{"floor-map", func(*testing.B) message.HandlerMiddleware {
			// The UUID-keyed Deduplicator's own work without its
			// per-message timeout context: a mutex map insert of the UUID
			// that is never undone (no lease, token, fingerprint or
			// completion: the design that loses a failed first delivery).
			var mu sync.Mutex
			seen := map[string]struct{}{}
			return func(h message.HandlerFunc) message.HandlerFunc {
				return func(m *message.Message) ([]*message.Message, error) {
					mu.Lock()
					_, dup := seen[m.UUID]
					seen[m.UUID] = struct{}{}
					mu.Unlock()
					if dup {
						return nil, nil
					}
					return h(m)
				}
			}
		}},
		{"watermill-default", func(*testing.B) message.HandlerMiddleware {
			return (&middleware.Deduplicator{}).Middleware
		}},
		{"watermill-uuid", func(*testing.B) message.HandlerMiddleware {
			d := &middleware.Deduplicator{KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil }}
			return d.Middleware
		}},
		{"ours-memstore", func(b *testing.B) message.HandlerMiddleware {
			s, err := memstore.New()
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { s.Close() })
			return ours(b, s)
		}},
		{"ours-memstore-steady", func(b *testing.B) message.HandlerMiddleware {
			// The store at its steady size: 65,536 records at most, each
			// expiring as soon as it is completed, so new keys replace
			// expired records instead of growing the table (the cost of
			// ours without the table's growth; "new" only).
			s, err := memstore.New(memstore.WithCapacity(1 << 16))
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { s.Close() })
			mw, err := dedupwatermill.New(s, "bench", dedupwatermill.WithRetention(time.Nanosecond))
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { mw.Close() })
			return mw.Middleware
		}},
		{"ours-window", func(b *testing.B) message.HandlerMiddleware {
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
			b.Cleanup(func() { s.Close(); ms.Close() })
			return ours(b, s)
		}},
	}
	for range benchRounds {
		for _, kind := range []string{"new", "dup"} {
			for _, c := range cases {
				if kind == "dup" && strings.HasSuffix(c.name, "-steady") {
					continue // its records expire at once: nothing to redeliver
				}
				b.Run(kind+"/"+c.name, func(b *testing.B) {
					mw := c.mw(b)
					var ran atomic.Int64
					h := mw(func(*message.Message) ([]*message.Message, error) { ran.Add(1); return nil, nil })
					base := rand.Int() >> 8
					const hot = 1024 // the redelivered set of the dup case
					if kind == "dup" {
						for i := range hot {
							m := message.NewMessage("msg-"+strconv.Itoa(base+i), payload(base+i))
							if _, err := h(m); err != nil {
								b.Fatal(err)
							}
							m.Ack()
						}
						time.Sleep(50 * time.Millisecond) // let the completions land
						ran.Store(0)
					}
					b.ReportAllocs()
					cpu := cpuTime()
					b.ResetTimer()
					for i := 0; i < b.N; i++ {
						n := base + i
						if kind == "dup" {
							n = base + i%hot
						}
						m := message.NewMessage("msg-"+strconv.Itoa(n), payload(n))
						if _, err := h(m); err != nil {
							b.Fatal(err)
						}
						m.Ack()
					}
					b.StopTimer()
					b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
					if kind == "new" {
						b.ReportMetric(float64(int64(b.N)-ran.Load())/float64(b.N), "lost/op")
					} else {
						b.ReportMetric(float64(ran.Load())/float64(b.N), "reruns/op")
					}
				})
			}
		}
	}
}

// benchRounds is how many times each benchmark runs all its cases in
// turn, so that the machine's load drifts over every case alike (run with
// -count=1; a name repeated gets a #01 suffix).
const benchRounds = 3

// cpuTime is the process's CPU time (user and system, every thread: the
// completer and the garbage collector included) in nanoseconds. On a
// shared machine it is steadier than wall time.
func cpuTime() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

func ours(b *testing.B, s dedup.Store) message.HandlerMiddleware {
	mw, err := dedupwatermill.New(s, "bench")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { mw.Close() })
	return mw.Middleware
}

// BenchmarkRedis is our middleware on the real Redis against no
// deduplication, with 64 handlers in flight per core (a router with
// concurrent handlers): one claim round trip per message, completions
// batched after the acks.
func BenchmarkRedis(b *testing.B) {
	addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	for range benchRounds {
		for _, name := range []string{"plain", "ours-redis"} {
			b.Run(name, func(b *testing.B) {
				h := func(*message.Message) ([]*message.Message, error) { return nil, nil }
				if name != "plain" {
					s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, redisstore.WithPrefix(fmt.Sprintf("dedupwatermill-bench-%x:", rand.Uint64())))
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { s.Close() })
					mw, err := dedupwatermill.New(s, "bench", dedupwatermill.WithRetention(time.Minute))
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(func() { mw.Close() })
					h = mw.Middleware(h)
				}
				var seq atomic.Int64
				base := rand.Int() >> 8
				b.SetParallelism(64)
				b.ReportAllocs()
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						i := base + int(seq.Add(1))
						m := message.NewMessage("msg-"+strconv.Itoa(i), payload(i))
						if _, err := h(m); err != nil {
							b.Error(err)
							return
						}
						m.Ack()
					}
				})
			})
		}
	}
}
