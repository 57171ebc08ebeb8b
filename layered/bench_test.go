package layered_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/dedupkit/dedup/window"
	"github.com/jackc/pgx/v5"
	"github.com/redis/rueidis"
)

// inboxStep is one delivery of message id through a durable inbox whose
// handler writes one ledger row.
type inboxStep func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error)

// duplicateStream runs a stream in which every message arrives twice in a
// row (50% duplicates, a crashed batch redelivered) through the durable
// inbox alone and with an exact window in front. One op is one delivery.
func duplicateStream(b *testing.B, durable inboxStep) {
	for _, withWindow := range []bool{false, true} {
		name := "store-only"
		var lay *layered.Store
		if withWindow {
			name = "window+store"
			w, _ := window.New()
			lay, _ = layered.New(layered.WithWindow(w))
		}
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			prefix := fmt.Sprintf("%s-%08x-", name, rand.Uint32())
			run := 0
			for b.Loop() {
				id := prefix + strconv.Itoa(run/2)
				run++
				key := dedup.Key{Scope: "bench", ID: id}
				step := func(ctx context.Context) (dedup.Claim, error) { return durable(ctx, key, id) }
				var c dedup.Claim
				var err error
				if lay != nil {
					c, err = lay.RunInbox(ctx, key, "", time.Hour, step)
				} else {
					c, err = step(ctx)
				}
				if err != nil || (c.Outcome != dedup.Acquired && c.Outcome != dedup.Duplicate) {
					b.Fatal(c.Outcome, err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "deliveries/s")
		})
	}
}

// BenchmarkDuplicateStream: the SQLite inbox (synchronous=FULL).
// Run: go test -run XXX -bench DuplicateStream -benchtime 3000x ./layered/
func BenchmarkDuplicateStream(b *testing.B) {
	s, err := sqlitestore.Open(filepath.Join(b.TempDir(), "bench.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	if _, err := s.DB().Exec(`CREATE TABLE ledger (msg_id TEXT NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	duplicateStream(b, func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
		return s.RunInbox(ctx, key, "", time.Hour, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			_, err := tx.ExecContext(ctx, `INSERT INTO ledger (msg_id) VALUES (?)`, id)
			return nil, err
		})
	})
}

// BenchmarkDuplicateStreamPostgres: the PostgreSQL inbox, where a
// duplicate costs the durable store a whole transaction over the network.
func BenchmarkDuplicateStreamPostgres(b *testing.B) {
	ctx := context.Background()
	schema := fmt.Sprintf("bench_layered_%08x", rand.Uint32())
	s, err := pgstore.Open(ctx, testenv.PostgresURL(b), pgstore.WithSchema(schema))
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		s.Pool().Exec(ctx, `DROP SCHEMA `+schema+` CASCADE`)
		s.Close()
	}()
	if _, err := s.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	if _, err := s.Pool().Exec(ctx, `CREATE TABLE `+schema+`.ledger (msg_id text NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	insert := `INSERT INTO ` + schema + `.ledger (msg_id) VALUES ($1)`
	duplicateStream(b, func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
		return s.RunInbox(ctx, key, "", time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, insert, id)
			return nil, err
		})
	})
}

// streamCase is one configuration of a rotated duplicate-stream benchmark:
// deliver sends one delivery of message id.
type streamCase struct {
	name    string
	deliver inboxStep
}

// layeredCase puts lay in front of the durable step.
func layeredCase(name string, lay *layered.Store, durable inboxStep) streamCase {
	return streamCase{name, func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
		return lay.RunInbox(ctx, key, "", time.Hour, func(ctx context.Context) (dedup.Claim, error) { return durable(ctx, key, id) })
	}}
}

// rotatedStream runs the 50%-duplicate stream (every message twice in a
// row) through every case in the same process, interleaved: each
// iteration gives each case chunk deliveries, starting with a different
// case each time, so that the machine's load falls on all of them alike.
// It reports each case's deliveries/s and its ratio to the first case.
func rotatedStream(b *testing.B, chunk int, cases []streamCase) {
	ctx := context.Background()
	prefix := fmt.Sprintf("%08x-", rand.Uint32())
	took := make([]time.Duration, len(cases))
	next := make([]int, len(cases))
	round := 0
	for b.Loop() {
		for j := range cases {
			ci := (round + j) % len(cases)
			c := cases[ci]
			start := time.Now()
			for range chunk {
				id := prefix + c.name + "-" + strconv.Itoa(next[ci]/2)
				next[ci]++
				cl, err := c.deliver(ctx, dedup.Key{Scope: "bench", ID: id}, id)
				if err != nil || (cl.Outcome != dedup.Acquired && cl.Outcome != dedup.Duplicate) {
					b.Fatal(c.name, cl.Outcome, err)
				}
			}
			took[ci] += time.Since(start)
		}
		round++
	}
	base := float64(next[0]) / took[0].Seconds()
	for i, c := range cases {
		rate := float64(next[i]) / took[i].Seconds()
		b.ReportMetric(rate, c.name+"/s")
		if i > 0 {
			b.ReportMetric(rate/base, c.name+"/x")
		}
	}
}

// fastLayers returns the layered stores in front of a durable step: the
// window alone, the window and the Redis filter, and the window and a
// claiming Redis store (the configuration before the filter).
func fastLayers(b *testing.B) (winOnly, winFilter, winClaim *layered.Store) {
	addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	mk := func(opts ...layered.Option) *layered.Store {
		w, err := window.New()
		if err != nil {
			b.Fatal(err)
		}
		lay, err := layered.New(append(opts, layered.WithWindow(w))...)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { lay.Close() })
		return lay
	}
	claim, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs},
		redisstore.WithPrefix(fmt.Sprintf("bench-layered-%08x:", rand.Uint32())))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { claim.Close() })
	return mk(), mk(layered.WithFilter(redisFilter(b, addrs), "redis")), mk(layered.WithFast(claim, "redis"))
}

// rotatedCases is store alone, window + store, window + Redis filter +
// store, window + claiming Redis + store, and Redis filter + store
// without a window (where every duplicate reaches Redis: what a lookup
// hit saves), for the durable step.
func rotatedCases(b *testing.B, durable inboxStep) []streamCase {
	winOnly, winFilter, winClaim := fastLayers(b)
	addrs := testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
	filterOnly, err := layered.New(layered.WithFilter(redisFilter(b, addrs), "redis"))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { filterOnly.Close() })
	return []streamCase{
		{"store", durable},
		layeredCase("window+store", winOnly, durable),
		layeredCase("window+redisfilter+store", winFilter, durable),
		layeredCase("window+redisclaim+store", winClaim, durable),
		layeredCase("redisfilter+store", filterOnly, durable),
	}
}

// pgBench opens a PostgreSQL store in a schema of its own with a ledger
// table, and returns it with the ledger's insert.
func pgBench(b *testing.B) (*pgstore.Store, string) {
	ctx := context.Background()
	schema := fmt.Sprintf("bench_layered_%08x", rand.Uint32())
	s, err := pgstore.Open(ctx, testenv.PostgresURL(b), pgstore.WithSchema(schema))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		s.Pool().Exec(ctx, `DROP SCHEMA `+schema+` CASCADE`)
		s.Close()
	})
	if _, err := s.Migrate(ctx); err != nil {
		b.Fatal(err)
	}
	if _, err := s.Pool().Exec(ctx, `CREATE TABLE `+schema+`.ledger (msg_id text NOT NULL)`); err != nil {
		b.Fatal(err)
	}
	return s, `INSERT INTO ` + schema + `.ledger (msg_id) VALUES ($1)`
}

// BenchmarkRotated: the 50%-duplicate stream through PostgreSQL's Apply,
// PostgreSQL's RunInbox and SQLite's RunInbox, each alone and behind the
// fast layers, the cases interleaved in one process.
// Run: go test -run '^$' -bench Rotated -benchtime 20x ./layered/
func BenchmarkRotated(b *testing.B) {
	b.Run("pg-apply", func(b *testing.B) {
		s, insert := pgBench(b)
		rotatedStream(b, 100, rotatedCases(b, func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
			var batch pgx.Batch
			batch.Queue(insert, id)
			return s.Apply(ctx, key, "", time.Hour, nil, &batch)
		}))
	})
	b.Run("pg-runinbox", func(b *testing.B) {
		s, insert := pgBench(b)
		rotatedStream(b, 100, rotatedCases(b, func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
			return s.RunInbox(ctx, key, "", time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				_, err := tx.Exec(ctx, insert, id)
				return nil, err
			})
		}))
	})
	b.Run("sqlite", func(b *testing.B) {
		s, err := sqlitestore.Open(filepath.Join(b.TempDir(), "bench.db"))
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		if _, err := s.DB().Exec(`CREATE TABLE ledger (msg_id TEXT NOT NULL)`); err != nil {
			b.Fatal(err)
		}
		rotatedStream(b, 100, rotatedCases(b, func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
			return s.RunInbox(ctx, key, "", time.Hour, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
				_, err := tx.ExecContext(ctx, `INSERT INTO ledger (msg_id) VALUES (?)`, id)
				return nil, err
			})
		}))
	})
}

// setFloor is the cheapest way to keep a shared Redis record of completed
// keys current: no lookups, no gate, no encoding; one plain SET PX of a
// value the size of the filter's (a 7-byte expiry and an empty
// fingerprint) per new key, queued to one background goroutine that
// batches what arrives within the filter's 10 ms linger into one
// pipeline, as the layered store's writer does.
type setFloor struct {
	client rueidis.Client
	prefix string
	ch     chan dedup.Key
	done   chan struct{}
}

func newSetFloor(b *testing.B, addrs []string) *setFloor {
	client, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: addrs})
	if err != nil {
		b.Fatal(err)
	}
	f := &setFloor{client: client, prefix: fmt.Sprintf("layered-setfloor-%016x:", rand.Uint64()),
		ch: make(chan dedup.Key, 4096), done: make(chan struct{})}
	go f.loop()
	b.Cleanup(func() {
		close(f.ch)
		<-f.done
		client.Close()
	})
	return f
}

func (f *setFloor) queue(k dedup.Key) {
	select {
	case f.ch <- k:
	default:
	}
}

func (f *setFloor) loop() {
	defer close(f.done)
	value := rueidis.BinaryString([]byte{0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 0})
	cmds := make(rueidis.Commands, 0, 256)
	for k := range f.ch {
		time.Sleep(10 * time.Millisecond)
		cmds = cmds[:0]
		for {
			cmds = append(cmds, f.client.B().Set().Key(f.prefix+strconv.Itoa(len(k.Scope))+":"+k.Scope+":"+k.ID).
				Value(value).PxMilliseconds(time.Hour.Milliseconds()).Build())
			if len(cmds) == cap(cmds) {
				break
			}
			var ok bool
			select {
			case k, ok = <-f.ch:
			default:
			}
			if !ok {
				break
			}
		}
		f.client.DoMulti(context.Background(), cmds...)
	}
}

// BenchmarkFilterFloor measures what the Redis filter costs against the
// floor of any shared filter that other instances can read: the window +
// PostgreSQL Apply configuration, the same with setFloor's one background
// SET per new key (window+setfloor+store), and window + the Redis filter
// + store, rotated in one process on the 50%-duplicate stream. The window
// catches every duplicate here, so the filter's lookups back off and what
// the filter adds over window + store is its write; the floor case shows
// what that write costs at the least.
// Run: go test -run '^$' -bench FilterFloor -benchtime 40x ./layered/
func BenchmarkFilterFloor(b *testing.B) {
	s, insert := pgBench(b)
	durable := func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
		var batch pgx.Batch
		batch.Queue(insert, id)
		return s.Apply(ctx, key, "", time.Hour, nil, &batch)
	}
	winOnly, winFilter, _ := fastLayers(b)
	winFloor, _, _ := fastLayers(b)
	floor := newSetFloor(b, testenv.Addrs(b, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis"))
	rotatedStream(b, 100, []streamCase{
		layeredCase("window+store", winOnly, durable),
		layeredCase("window+setfloor+store", winFloor, func(ctx context.Context, key dedup.Key, id string) (dedup.Claim, error) {
			c, err := durable(ctx, key, id)
			if err == nil && c.Outcome == dedup.Acquired {
				floor.queue(key)
			}
			return c, err
		}),
		layeredCase("window+redisfilter+store", winFilter, durable),
	})
	// The filter's lookups in the run: the gate starts open (32 lookups),
	// then probes one window miss in 32, backing off to one in 1024.
	b.ReportMetric(float64(winFilter.Stats().Lookups)/float64(b.N*50), "lookups/new")
}
