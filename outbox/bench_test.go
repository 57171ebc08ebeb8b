package outbox_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// benchRig is a PostgreSQL outbox for benchmarks, with a JetStream
// stream.
type benchRig struct {
	*rig
	js     jetstream.JetStream
	stream string
}

func newBenchRig(b *testing.B, parts int) *benchRig {
	r := newRig(b, pgstore.WithOutboxPartitions(parts), pgstore.WithOutboxDeletePublished())
	js, stream := jetStream(b)
	if err := r.src.CreateIndex(context.Background()); err != nil {
		b.Fatal(err)
	}
	return &benchRig{rig: r, js: js, stream: stream}
}

// fill writes n rows over keys aggregates in one statement.
func (r *benchRig) fill(b *testing.B, n, keys int) {
	b.Helper()
	// The case before left the table's rows deleted. VACUUM cannot
	// remove them while another session on the shared server holds an
	// older snapshot, and the case after the bare loop (one DELETE of
	// every row at its end) then read through 50,000 dead index entries:
	// TRUNCATE starts each case on an empty file instead.
	if _, err := r.s.Pool().Exec(context.Background(), `TRUNCATE `+r.s.Tables().Outbox); err != nil {
		b.Fatal(err)
	}
	_, err := r.s.Pool().Exec(context.Background(), `INSERT INTO `+r.s.Tables().Outbox+` (message_key, aggregate, topic, payload)
SELECT 'evt-' || gen_random_uuid(), 'agg-' || (g % $2), $3, convert_to(repeat('x', 200), 'UTF8') FROM generate_series(1, $1) g`, n, keys, r.stream+".bench")
	if err != nil {
		b.Fatal(err)
	}
}

// bare reads the rows in batches and publishes them with asynchronous
// acks, the loop a relay is measured against: no leases, no marks.
func (r *benchRig) bare(b *testing.B, n int) {
	ctx := context.Background()
	var last int64
	for done := 0; done < n; {
		rows, err := r.s.Pool().Query(ctx, `SELECT id, message_key, aggregate, topic, payload FROM `+r.s.Tables().Outbox+` WHERE id > $1 ORDER BY id LIMIT 500`, last)
		if err != nil {
			b.Fatal(err)
		}
		var futures []jetstream.PubAckFuture
		for rows.Next() {
			var id int64
			var key, agg, topic string
			var payload []byte
			if err := rows.Scan(&id, &key, &agg, &topic, &payload); err != nil {
				b.Fatal(err)
			}
			last = id
			f, err := r.js.PublishMsgAsync(&nats.Msg{Subject: topic, Data: payload,
				Header: nats.Header{"Nats-Msg-Id": []string{key}, dedupnats.HeaderMsgID: []string{key}, dedupnats.HeaderAggregate: []string{agg}}})
			if err != nil {
				b.Fatal(err)
			}
			futures = append(futures, f)
		}
		rows.Close()
		for _, f := range futures {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				b.Fatal(err)
			}
		}
		done += len(futures)
	}
	if _, err := r.s.Pool().Exec(ctx, `DELETE FROM `+r.s.Tables().Outbox); err != nil {
		b.Fatal(err)
	}
}

// relays starts k relays, waits until they have split the partitions,
// calls fill (the rows become visible when its INSERT commits, just
// before it returns) and returns the time from then until the relays
// have marked want rows (their own counts, read in memory: polling the
// table would load the database under test). With fill nil the rows are
// there already and the time counts from the start of the relays, their
// start-up included.
func (r *benchRig) relays(b *testing.B, k int, src outbox.Source, want int64, fill func(), opts ...outbox.Option) time.Duration {
	pub, err := dedupnats.NewOutboxPublisher(r.js, 30*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var rls []*outbox.Relay
	start := time.Now()
	for i := range k {
		rl, err := outbox.NewRelay(src, pub, append([]outbox.Option{outbox.WithRelayID(fmt.Sprint("bench-", i)), outbox.WithPollInterval(5 * time.Millisecond),
			outbox.WithLeaseTTL(2 * time.Second)}, opts...)...)
		if err != nil {
			b.Fatal(err)
		}
		rls = append(rls, rl)
		wg.Go(func() { rl.Run(ctx) })
	}
	n := src.Partitions()
	fair := (n + k - 1) / k
	for fill != nil {
		total, ok := 0, true
		for _, rl := range rls {
			p := rl.Stats().Partitions
			total += p
			ok = ok && p <= fair
		}
		if ok && total == n {
			break
		}
		time.Sleep(time.Millisecond)
	}
	b.StartTimer()
	if fill != nil {
		fill()
		start = time.Now()
	}
	for {
		var done int64
		for _, rl := range rls {
			done += rl.Stats().Published
		}
		if done >= want {
			break
		}
		time.Sleep(time.Millisecond)
	}
	took := time.Since(start)
	b.StopTimer()
	cancel()
	wg.Wait()
	return took
}

// noReadAhead hides a source's [outbox.Prefetcher] (and keeps its
// notifications).
type noReadAhead struct {
	outbox.Source
	outbox.Notifier
}

// timedBare fills the table and times the bare async-ack loop over it.
func (r *benchRig) timedBare(b *testing.B, rows int, fill func()) time.Duration {
	fill()
	b.StartTimer()
	start := time.Now()
	r.bare(b, rows)
	took := time.Since(start)
	b.StopTimer()
	return took
}

// BenchmarkRelayThroughput publishes rows from PostgreSQL to the real
// JetStream server: a bare async-ack loop, one relay and four relays (16
// partitions), the cases rotated in each round; msg/s per case.
func BenchmarkRelayThroughput(b *testing.B) {
	const rows, keys = 50000, 1000
	r := newBenchRig(b, 16)
	src := r.src
	fill := func() { r.fill(b, rows, keys) }
	cases := []struct {
		name string
		run  func() time.Duration
	}{
		{"bare-async-loop", func() time.Duration { return r.timedBare(b, rows, fill) }},
		{"relay-1", func() time.Duration { return r.relays(b, 1, src, rows, fill) }},
		{"relay-4", func() time.Duration { return r.relays(b, 4, src, rows, fill) }},
		// The relay without its read-ahead (the source seen without
		// FetchNext): what pipelining the next read buys.
		{"relay-1-no-read-ahead", func() time.Duration { return r.relays(b, 1, noReadAhead{src, src}, rows, fill) }},
	}
	took := map[string][]float64{}
	for round := 0; b.Loop(); round++ {
		b.StopTimer()
		for i := range cases {
			c := cases[(i+round)%len(cases)]
			took[c.name] = append(took[c.name], float64(rows)/c.run().Seconds())
		}
		b.StartTimer()
	}
	for _, c := range cases {
		b.ReportMetric(median(took[c.name]), c.name+"-msg/s")
	}
}

// BenchmarkSQLiteRelayThroughput: the SQLite relay (1 partition) to the
// real JetStream server.
func BenchmarkSQLiteRelayThroughput(b *testing.B) {
	const rows = 10000
	js, stream := jetStream(b)
	s, err := sqlitestore.Open(filepath.Join(b.TempDir(), "bench.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	src, err := s.OutboxSource(ctx, 1)
	if err != nil {
		b.Fatal(err)
	}
	r := &benchRig{js: js, stream: stream}
	msgs := make([]outbox.Message, 500)
	var rates []float64
	for b.Loop() {
		b.StopTimer()
		for done := 0; done < rows; done += len(msgs) {
			tx, err := s.DB().BeginTx(ctx, nil)
			if err != nil {
				b.Fatal(err)
			}
			for i := range msgs {
				msgs[i] = outbox.Message{Topic: stream + ".bench", Key: fmt.Sprint("agg-", (done+i)%1000), Payload: make([]byte, 200)}
			}
			if err := s.WriteOutbox(ctx, tx, msgs...); err != nil {
				b.Fatal(err)
			}
			tx.Commit()
		}
		took := r.relays(b, 1, src, rows, nil)
		rates = append(rates, float64(rows)/took.Seconds())
		b.StartTimer()
	}
	b.ReportMetric(median(rates), "msg/s")
}

// BenchmarkCommitToPublish measures the latency from a message's insert
// (its transaction commits at once) to the broker's acknowledgement, with
// NOTIFY (poll 1s) and poll-only (every 100ms), the cases rotated; p50 and
// p99 per case.
func BenchmarkCommitToPublish(b *testing.B) {
	r := newBenchRig(b, 4)
	pub, err := dedupnats.NewOutboxPublisher(r.js, 30*time.Second)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	lat := map[string][]time.Duration{}
	for round := 0; b.Loop(); round++ {
		for i, name := range []string{"notify", "poll-100ms"} {
			name = []string{"notify", "poll-100ms"}[(i+round)%2]
			var mu sync.Mutex
			var got []time.Duration
			opts := []outbox.Option{outbox.WithPublishedHook(func(_ int, ms []outbox.Message) {
				now := time.Now()
				mu.Lock()
				for _, m := range ms {
					got = append(got, now.Sub(m.CreatedAt))
				}
				mu.Unlock()
			}), outbox.WithLeaseTTL(2 * time.Second)}
			if name == "notify" {
				opts = append(opts, outbox.WithPollInterval(time.Second))
			} else {
				opts = append(opts, outbox.WithPollOnly(), outbox.WithPollInterval(100*time.Millisecond))
			}
			rl, err := outbox.NewRelay(r.src, pub, opts...)
			if err != nil {
				b.Fatal(err)
			}
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { rl.Run(rctx); close(done) }()
			for rl.Stats().Partitions < 4 {
				time.Sleep(time.Millisecond)
			}
			const n = 200
			for j := range n {
				r.write(outbox.Message{Topic: r.stream + ".lat", Key: fmt.Sprint("k", j%8)})
				time.Sleep(2 * time.Millisecond)
			}
			for {
				mu.Lock()
				k := len(got)
				mu.Unlock()
				if k >= n {
					break
				}
				time.Sleep(time.Millisecond)
			}
			cancel()
			<-done
			lat[name] = append(lat[name], got...)
		}
	}
	for name, ds := range lat {
		slices.Sort(ds)
		b.ReportMetric(float64(ds[len(ds)/2].Microseconds())/1000, name+"-p50-ms")
		b.ReportMetric(float64(ds[len(ds)*99/100].Microseconds())/1000, name+"-p99-ms")
	}
}

// BenchmarkWriterOverhead compares a business transaction (UPDATE one
// row, COMMIT) with the same transaction writing one outbox message,
// rotated per iteration; ns per transaction of each and their ratio.
func BenchmarkWriterOverhead(b *testing.B) {
	r := newRig(b)
	ctx := context.Background()
	pool := r.s.Pool()
	acct := r.s.Tables().Schema + ".accounts"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+acct+` (id int PRIMARY KEY, balance bigint NOT NULL); INSERT INTO `+acct+` SELECT g, 0 FROM generate_series(0, 63) g`); err != nil {
		b.Fatal(err)
	}
	business := func(tx pgx.Tx, i int) error {
		_, err := tx.Exec(ctx, `UPDATE `+acct+` SET balance = balance + 1 WHERE id = $1`, i%64)
		return err
	}
	cases := []struct {
		name string
		tx   func(i int) error
	}{
		{"bare-tx", func(i int) error { return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return business(tx, i) }) }},
		{"tx+outbox", func(i int) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if err := business(tx, i); err != nil {
					return err
				}
				return r.s.WriteOutbox(ctx, tx, outbox.Message{Topic: "accounts.credited", Key: fmt.Sprint("acct-", i%64), Payload: make([]byte, 200)})
			})
		}},
		{"tx+outbox-same-batch", func(i int) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var bt pgx.Batch
				bt.Queue(`UPDATE `+acct+` SET balance = balance + 1 WHERE id = $1`, i%64)
				if err := r.s.QueueOutbox(&bt, outbox.Message{Topic: "accounts.credited", Key: fmt.Sprint("acct-", i%64), Payload: make([]byte, 200)}); err != nil {
					return err
				}
				return tx.SendBatch(ctx, &bt).Close()
			})
		}},
	}
	total := map[string]time.Duration{}
	counts := map[string]int{}
	i := 0
	for b.Loop() {
		for k := range cases {
			c := cases[(k+i)%len(cases)]
			start := time.Now()
			if err := c.tx(i); err != nil {
				b.Fatal(err)
			}
			total[c.name] += time.Since(start)
			counts[c.name]++
		}
		i++
	}
	bare := float64(total["bare-tx"]) / float64(counts["bare-tx"])
	b.ReportMetric(bare, "bare-tx-ns/tx")
	for _, c := range cases[1:] {
		with := float64(total[c.name]) / float64(counts[c.name])
		b.ReportMetric(with, c.name+"-ns/tx")
		b.ReportMetric(with/bare, c.name+"-x")
	}
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	sort.Float64s(s)
	return s[len(s)/2]
}

// BenchmarkRelayReadAhead: one relay on ONE partition (a single ordered
// stream, where nothing else overlaps a batch's round trips) as it runs
// (reading the next batch under the current one's acks and publishing it
// under the current one's mark), with the read ahead but every mark
// before the next publish, and with neither, against the bare loop;
// rotated; msg/s per case.
func BenchmarkRelayReadAhead(b *testing.B) {
	const rows, keys = 30000, 1000
	r := newBenchRig(b, 1)
	src := r.src
	fill := func() { r.fill(b, rows, keys) }
	cases := []struct {
		name string
		run  func() time.Duration
	}{
		{"bare-async-loop", func() time.Duration { return r.timedBare(b, rows, fill) }},
		{"relay-pipelined", func() time.Duration { return r.relays(b, 1, src, rows, fill) }},
		{"relay-read-ahead-only", func() time.Duration { return r.relays(b, 1, src, rows, fill, outbox.WithoutPipelinedMarks()) }},
		{"relay-no-read-ahead", func() time.Duration { return r.relays(b, 1, noReadAhead{src, src}, rows, fill) }},
	}
	took := map[string][]float64{}
	for round := 0; b.Loop(); round++ {
		b.StopTimer()
		for i := range cases {
			c := cases[(i+round)%len(cases)]
			took[c.name] = append(took[c.name], float64(rows)/c.run().Seconds())
		}
		b.StartTimer()
	}
	for _, c := range cases {
		b.ReportMetric(median(took[c.name]), c.name+"-msg/s")
	}
}
