package verify

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// OutboxConfig says what one `dedup verify --outbox` run does.
type OutboxConfig struct {
	// Store is "postgres" or "sqlite".
	Store string
	// PostgresURL is the server for Store "postgres"; the run makes a
	// schema of its own and drops it unless Keep.
	PostgresURL string
	// SQLitePath is the file for Store "sqlite" (empty: a temporary file).
	SQLitePath string
	// Broker is "nats" (a real JetStream server, the default), "rabbitmq"
	// (a real RabbitMQ server) or "kafka" (an in-process kfake cluster);
	// the relays publish with that adapter's outbox.Publisher.
	Broker string
	// NATSURL is the JetStream server.
	NATSURL string
	// AMQPURL is the RabbitMQ server.
	AMQPURL string
	// Events is how many business transactions the producers commit or
	// roll back; Producers how many run at once; Aggregates how many
	// aggregates they touch (each event bumps one aggregate's version).
	Events, Producers, Aggregates int
	// RollbackRate is the share of transactions rolled back after writing
	// their outbox row; HoldRate the share held open for Hold before
	// committing (the long-transaction window).
	RollbackRate, HoldRate float64
	Hold                   time.Duration
	// Relays run at once, over Partitions partitions.
	Relays, Partitions int
	// Batch is the rows a relay's partition reads and publishes at a
	// time. The relay faults below are drawn per batch, so a small run
	// needs small batches to draw any.
	Batch int
	// CrashRate is the chance per batch that a relay dies between the
	// broker's acknowledgements and the mark; KillRate that it dies in the
	// middle of a batch (part of it published). A dead relay is restarted
	// under a new name, as a supervisor would.
	CrashRate, KillRate float64
	// Lease is the relays' partition lease TTL.
	Lease time.Duration
	// Consumers is the number of consumer workers (each aggregate goes to
	// one worker, in stream order).
	Consumers int
	// Keep leaves the schema, file and stream for inspection.
	Keep bool
	// Seed seeds the producers' and relays' choices; 0 picks one.
	Seed uint64
	// Progress, if set, is called about every 500ms.
	Progress func(OutboxProgress)
}

// OutboxProgress is a snapshot for a progress display.
type OutboxProgress struct {
	Committed, RolledBack, Applied int64
	RelayCrashes                   int64
	Elapsed                        time.Duration
}

// DefaultOutboxConfig is `dedup verify --outbox` without other flags.
func DefaultOutboxConfig() OutboxConfig {
	return OutboxConfig{
		Store: "postgres", Broker: "nats", Events: 3000, Producers: 8, Aggregates: 40,
		RollbackRate: 0.1, HoldRate: 0.01, Hold: 2 * time.Second,
		Relays: 3, Partitions: 8, Batch: 100, CrashRate: 0.05, KillRate: 0.05, Lease: 500 * time.Millisecond,
		Consumers: 4,
	}
}

// Validate reports the first invalid field, naming its flag.
func (c *OutboxConfig) Validate() error {
	switch {
	case c.Broker != "" && c.Broker != "nats" && c.Broker != "rabbitmq" && c.Broker != "kafka":
		return fmt.Errorf("--broker must be nats, rabbitmq or kafka with --outbox, got %q", c.Broker)
	case c.Store != "postgres" && c.Store != "sqlite":
		return fmt.Errorf("--store must be postgres or sqlite with --outbox, got %q", c.Store)
	case c.Events < 1 || c.Events > 10_000_000:
		return fmt.Errorf("--messages must be between 1 and 10000000, got %d", c.Events)
	case c.Producers < 1 || c.Producers > 1000:
		return fmt.Errorf("--producers must be between 1 and 1000, got %d", c.Producers)
	case c.Aggregates < 1:
		return fmt.Errorf("--aggregates must be positive, got %d", c.Aggregates)
	case c.Relays < 1 || c.Relays > 64:
		return fmt.Errorf("--relays must be between 1 and 64, got %d", c.Relays)
	case c.Partitions < 1 || c.Partitions > 4096:
		return fmt.Errorf("--outbox-partitions must be between 1 and 4096, got %d", c.Partitions)
	case c.Batch < 1 || c.Batch > 10_000:
		return fmt.Errorf("--batch must be between 1 and 10000, got %d", c.Batch)
	case c.Consumers < 1 || c.Consumers > 1000:
		return fmt.Errorf("--consumers must be between 1 and 1000, got %d", c.Consumers)
	case c.Lease < 30*time.Millisecond:
		return fmt.Errorf("--lease must be at least 30ms, got %v", c.Lease)
	case c.Hold < 0:
		return fmt.Errorf("--hold must not be negative")
	}
	for _, r := range []struct {
		flag string
		v    float64
	}{{"--rollback-rate", c.RollbackRate}, {"--hold-rate", c.HoldRate}, {"--crash-rate", c.CrashRate}, {"--kill-rate", c.KillRate}} {
		if !(r.v >= 0 && r.v < 1) {
			return fmt.Errorf("%s must be a probability in [0, 1), got %v", r.flag, r.v)
		}
	}
	return nil
}

// OutboxReport is the outcome of a run; its JSON form is the output of
// `dedup verify --outbox --json`.
type OutboxReport struct {
	Store      string `json:"store"`
	Broker     string `json:"broker"`
	Stream     string `json:"stream"`
	Events     int    `json:"events"`
	Producers  int    `json:"producers"`
	Relays     int    `json:"relays"`
	Partitions int    `json:"partitions"`
	Consumers  int    `json:"consumers"`
	Seed       uint64 `json:"seed"`

	Committed    int   `json:"committed"`
	RolledBack   int   `json:"rolled_back"`
	Held         int   `json:"held_open"`
	RelayCrashes int64 `json:"relay_crashes_after_ack"`
	RelayKills   int64 `json:"relay_kills_mid_batch"`
	Published    int64 `json:"published_marked"` // marks made by the relays, re-marks excluded
	Deliveries   int64 `json:"deliveries"`
	// DuplicatesSkipped counts deliveries the consumer's dedup absorbed.
	DuplicatesSkipped int64 `json:"duplicates_skipped"`

	Lost             int      `json:"lost"`
	DoubleApplied    int      `json:"double_applied"`
	RolledBackSeen   int      `json:"rolled_back_delivered"`
	OrderViolations  int64    `json:"order_violations"`
	LostSample       []string `json:"lost_sample,omitempty"`
	ViolationSamples []string `json:"violation_sample,omitempty"`
	TimedOut         bool     `json:"timed_out"`
	Seconds          float64  `json:"seconds"`
	Throughput       float64  `json:"throughput"`
	OK               bool     `json:"ok"`
}

// Violations lists what went wrong, in words; empty when OK.
func (r *OutboxReport) Violations() []string {
	var v []string
	if r.Lost > 0 {
		v = append(v, fmt.Sprintf("%d committed events never applied", r.Lost))
	}
	if r.DoubleApplied > 0 {
		v = append(v, fmt.Sprintf("%d events applied more than once", r.DoubleApplied))
	}
	if r.RolledBackSeen > 0 {
		v = append(v, fmt.Sprintf("%d rolled-back events delivered", r.RolledBackSeen))
	}
	if r.OrderViolations > 0 {
		v = append(v, fmt.Sprintf("%d events applied out of their aggregate's order", r.OrderViolations))
	}
	if r.TimedOut {
		v = append(v, "timed out before every committed event was applied and marked published")
	}
	return v
}

// outboxSide is the store under test: producers' transactions, the relay's
// source, and the consumers' inbox with its ledger.
type outboxSide interface {
	// produce runs one business transaction on aggregate agg: bump its
	// version, write the event's outbox row, hold it open for hold, then
	// commit or roll back. It returns the version written.
	produce(ctx context.Context, agg, id string, hold time.Duration, commit bool) (uint64, error)
	source() outbox.Source
	// apply records event id of agg at version v once (inbox + ledger in
	// one transaction); dup reports a duplicate.
	apply(ctx context.Context, id, agg string, v uint64) (dup bool, err error)
	// ledger returns how many times each event was applied.
	ledger(ctx context.Context) (map[string]int, error)
	// backlog counts the outbox rows not yet marked published.
	backlog(ctx context.Context) (int, error)
	close(keep bool)
}

// RunOutbox drives producers, relays and consumers end to end over a real
// broker (a JetStream server, a RabbitMQ server, or an in-process kfake
// Kafka cluster; see OutboxConfig.Broker) and checks that every committed
// event was applied exactly once, no rolled-back event was delivered, and
// each aggregate's events were applied in version order.
func RunOutbox(ctx context.Context, cfg OutboxConfig) (OutboxReport, error) {
	if err := cfg.Validate(); err != nil {
		return OutboxReport{}, err
	}
	if cfg.Seed == 0 {
		cfg.Seed = rand.Uint64() | 1
	}
	if cfg.Broker == "" {
		cfg.Broker = "nats"
	}
	runID := strconv.FormatUint(rand.Uint64()>>24, 36)
	rep := OutboxReport{Store: cfg.Store, Broker: cfg.Broker, Events: cfg.Events, Producers: cfg.Producers, Relays: cfg.Relays,
		Partitions: cfg.Partitions, Consumers: cfg.Consumers, Seed: cfg.Seed}
	brk, err := openOutboxBroker(ctx, cfg, runID)
	if err != nil {
		return rep, err
	}
	defer brk.close(context.WithoutCancel(ctx), cfg.Keep)
	rep.Stream = brk.stream()
	side, err := openOutboxSide(ctx, cfg, runID, brk.topic())
	if err != nil {
		return rep, err
	}
	defer side.close(cfg.Keep)
	pub := brk.publisher()
	start := time.Now()
	var (
		committed  sync.Map // id -> agg
		rolledBack sync.Map
		nCommitted atomic.Int64
		nRolled    atomic.Int64
		nHeld      atomic.Int64
		applied    atomic.Int64
		dups       atomic.Int64
		deliveries atomic.Int64
		orderBad   atomic.Int64
		crashes    atomic.Int64
		kills      atomic.Int64
		published  atomic.Int64
		firstErr   atomic.Pointer[string]
	)
	setErr := func(err error) {
		s := err.Error()
		firstErr.CompareAndSwap(nil, &s)
	}
	rctx, stopAll := context.WithCancel(ctx)
	defer stopAll()

	// Consumers: the broker delivers each aggregate's events one at a time,
	// in order; handle applies one in the inbox and checks its version, and
	// the broker acknowledges it after handle returned true.
	var samples sync.Mutex
	var violation []string
	var lastMu sync.Mutex
	lastVersion := map[string]uint64{}
	handle := func(id, agg string, v uint64) bool {
		deliveries.Add(1)
		for {
			dup, err := side.apply(rctx, id, agg, v)
			if err != nil {
				if rctx.Err() != nil {
					return false
				}
				setErr(err)
				time.Sleep(10 * time.Millisecond)
				continue
			}
			if dup {
				dups.Add(1)
				return true
			}
			applied.Add(1)
			lastMu.Lock()
			last := lastVersion[agg]
			if v > last {
				lastVersion[agg] = v
			}
			lastMu.Unlock()
			if v != last+1 {
				orderBad.Add(1)
				samples.Lock()
				if len(violation) < 5 {
					violation = append(violation, fmt.Sprintf("%s: version %d applied after %d", agg, v, last))
				}
				samples.Unlock()
			}
			return true
		}
	}
	stopConsumers, err := brk.consume(rctx, cfg.Consumers, handle)
	if err != nil {
		return rep, err
	}

	// Relays, restarted under a new name when they die.
	var rwg sync.WaitGroup
	rng := rand.New(rand.NewPCG(cfg.Seed, cfg.Seed>>1|1))
	var rngMu sync.Mutex
	chance := func(p float64) bool { rngMu.Lock(); defer rngMu.Unlock(); return rng.Float64() < p }
	errCrash := errors.New("injected crash")
	for i := range cfg.Relays {
		rwg.Go(func() {
			for gen := 0; rctx.Err() == nil; gen++ {
				var killNow atomic.Bool
				fp := &faultyPublisher{inner: pub, kill: func() bool {
					if chance(cfg.KillRate) {
						killNow.Store(true)
						return true
					}
					return false
				}}
				rl, err := outbox.NewRelay(side.source(), fp, outbox.WithRelayID(fmt.Sprintf("verify-%s-%d-%d", runID, i, gen)),
					outbox.WithLeaseTTL(cfg.Lease), outbox.WithPollInterval(50*time.Millisecond), outbox.WithBatchSize(cfg.Batch),
					outbox.WithBackoff(10*time.Millisecond, 200*time.Millisecond), outbox.WithMaxAttempts(1000),
					outbox.WithMarkHook(func(int, []outbox.Message) error {
						if killNow.Load() {
							kills.Add(1)
							return errCrash
						}
						if chance(cfg.CrashRate) {
							crashes.Add(1)
							return errCrash
						}
						return nil
					}))
				if err != nil {
					setErr(err)
					return
				}
				err = rl.Run(rctx)
				published.Add(rl.Stats().Published)
				if err != nil && !errors.Is(err, errCrash) {
					setErr(err)
				}
				if !errors.Is(err, errCrash) {
					return
				}
				select { // a supervisor's restart delay
				case <-rctx.Done():
				case <-time.After(cfg.Lease / 2):
				}
			}
		})
	}

	// Producers.
	jobs := make(chan int)
	var pwg sync.WaitGroup
	for range cfg.Producers {
		pwg.Go(func() {
			for n := range jobs {
				agg := fmt.Sprintf("agg-%s-%d", runID, n%cfg.Aggregates)
				id := fmt.Sprintf("evt-%s-%d", runID, n)
				commit := !chance(cfg.RollbackRate)
				var hold time.Duration
				if chance(cfg.HoldRate) {
					hold = cfg.Hold
					nHeld.Add(1)
				}
				for {
					_, err := side.produce(rctx, agg, id, hold, commit)
					if err == nil {
						break
					}
					if rctx.Err() != nil {
						return
					}
					setErr(err) // a failed commit is retried as a new transaction
					time.Sleep(10 * time.Millisecond)
				}
				if commit {
					committed.Store(id, agg)
					nCommitted.Add(1)
				} else {
					rolledBack.Store(id, agg)
					nRolled.Add(1)
				}
			}
		})
	}
	progressDone := make(chan struct{})
	go func() {
		t := time.NewTicker(500 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-progressDone:
				return
			case <-t.C:
				if cfg.Progress != nil {
					cfg.Progress(OutboxProgress{Committed: nCommitted.Load(), RolledBack: nRolled.Load(), Applied: applied.Load(),
						RelayCrashes: crashes.Load() + kills.Load(), Elapsed: time.Since(start)})
				}
			}
		}
	}()
	for n := 0; n < cfg.Events && rctx.Err() == nil; n++ {
		select {
		case jobs <- n:
		case <-rctx.Done():
		}
	}
	close(jobs)
	pwg.Wait()
	// Wait until every committed event is applied (or ctx ends), then a
	// little longer for stray deliveries.
	for applied.Load() < nCommitted.Load() && ctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
	}
	// Then until the relays have marked every row (a row acknowledged by
	// the broker but not marked is sent again and marked by the heir).
	for ctx.Err() == nil {
		n, err := side.backlog(ctx)
		if err == nil && n == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	rep.TimedOut = ctx.Err() != nil
	time.Sleep(3 * cfg.Lease)
	close(progressDone)
	stopAll()
	rwg.Wait()
	stopConsumers()
	elapsed := time.Since(start)

	lctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	led, err := side.ledger(lctx)
	if err != nil {
		return rep, fmt.Errorf("verify: read the ledger: %w", err)
	}
	rep.Committed, rep.RolledBack, rep.Held = int(nCommitted.Load()), int(nRolled.Load()), int(nHeld.Load())
	rep.RelayCrashes, rep.RelayKills, rep.Published = crashes.Load(), kills.Load(), published.Load()
	rep.Deliveries, rep.DuplicatesSkipped, rep.OrderViolations = deliveries.Load(), dups.Load(), orderBad.Load()
	committed.Range(func(k, _ any) bool {
		switch n := led[k.(string)]; {
		case n == 0:
			rep.Lost++
			if len(rep.LostSample) < 5 {
				rep.LostSample = append(rep.LostSample, k.(string))
			}
		case n > 1:
			rep.DoubleApplied++
		}
		return true
	})
	rolledBack.Range(func(k, _ any) bool {
		if led[k.(string)] > 0 {
			rep.RolledBackSeen++
		}
		return true
	})
	rep.ViolationSamples = violation
	if p := firstErr.Load(); p != nil && len(rep.ViolationSamples) < 5 {
		rep.ViolationSamples = append(rep.ViolationSamples, "first transient error: "+*p)
	}
	rep.Seconds = elapsed.Seconds()
	if rep.Seconds > 0 {
		rep.Throughput = float64(rep.Committed) / rep.Seconds
	}
	rep.OK = len(rep.Violations()) == 0
	return rep, nil
}

// faultyPublisher publishes a batch, or with kill only a prefix of it
// (the relay then dies before marking anything: killed mid-batch).
type faultyPublisher struct {
	inner outbox.Publisher
	kill  func() bool
}

func (f *faultyPublisher) Publish(ctx context.Context, batch []outbox.Message, results []error) {
	if len(batch) > 1 && f.kill() {
		half := len(batch) / 2
		f.inner.Publish(ctx, batch[:half], results[:half])
		for i := half; i < len(batch); i++ {
			results[i] = outbox.ErrNotSent
		}
		return
	}
	f.inner.Publish(ctx, batch, results)
}

func openOutboxSide(ctx context.Context, cfg OutboxConfig, runID, topic string) (outboxSide, error) {
	if cfg.Store == "sqlite" {
		return openSQLiteOutbox(ctx, cfg, topic)
	}
	return openPGOutbox(ctx, cfg, runID, topic)
}

// event is the outbox message of event id: version v of aggregate agg.
func event(topic, id, agg string, v uint64) outbox.Message {
	return outbox.Message{ID: id, Topic: topic, Key: agg, Payload: []byte(strconv.FormatUint(v, 10)),
		Headers: map[string]string{dedupnats.HeaderVersion: strconv.FormatUint(v, 10), dedupnats.HeaderAggregate: agg}}
}

// ---- PostgreSQL ----

type pgOutbox struct {
	pool   *pgxpool.Pool
	s      *pgstore.Store
	src    *pgstore.OutboxSource
	schema string
	topic  string
	aggs   string
	ledg   string
}

func openPGOutbox(ctx context.Context, cfg OutboxConfig, runID, topic string) (*pgOutbox, error) {
	pcfg, err := pgxpool.ParseConfig(cfg.PostgresURL)
	if err != nil {
		return nil, fmt.Errorf("verify: PostgreSQL URL: %w", err)
	}
	pcfg.MaxConns = int32(cfg.Producers + cfg.Consumers + 4*cfg.Relays + 4)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, err
	}
	schema := "dedup_verify_outbox_" + runID
	s, err := pgstore.New(pool, pgstore.WithSchema(schema))
	if err == nil {
		_, err = s.Migrate(ctx)
	}
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("verify: PostgreSQL at %s: %w", cfg.PostgresURL, err)
	}
	o := &pgOutbox{pool: pool, s: s, schema: schema, topic: topic,
		aggs: pgx.Identifier{schema, "aggregates"}.Sanitize(), ledg: pgx.Identifier{schema, "ledger"}.Sanitize()}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+o.aggs+` (id text PRIMARY KEY, version bigint NOT NULL);
CREATE TABLE `+o.ledg+` (event text NOT NULL, agg text NOT NULL, version bigint NOT NULL)`); err != nil {
		o.close(false)
		return nil, err
	}
	if o.src, err = s.OutboxSource(pgstore.WithOutboxPartitions(cfg.Partitions)); err != nil {
		o.close(false)
		return nil, err
	}
	return o, nil
}

func (o *pgOutbox) produce(ctx context.Context, agg, id string, hold time.Duration, commit bool) (uint64, error) {
	tx, err := o.pool.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	var v uint64
	if err := tx.QueryRow(ctx, `INSERT INTO `+o.aggs+` AS a VALUES ($1, 1) ON CONFLICT (id) DO UPDATE SET version = a.version + 1 RETURNING version`, agg).Scan(&v); err != nil {
		return 0, err
	}
	if err := o.s.WriteOutbox(ctx, tx, event(o.topic, id, agg, v)); err != nil {
		return 0, err
	}
	if hold > 0 {
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(hold):
		}
	}
	if !commit {
		return v, tx.Rollback(ctx)
	}
	return v, tx.Commit(ctx)
}

func (o *pgOutbox) source() outbox.Source { return o.src }

func (o *pgOutbox) apply(ctx context.Context, id, agg string, v uint64) (bool, error) {
	c, err := o.s.RunInbox(ctx, dedup.Key{Scope: "verify-outbox", ID: id}, "", time.Hour, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		_, err := tx.Exec(ctx, `INSERT INTO `+o.ledg+` VALUES ($1, $2, $3)`, id, agg, int64(v))
		return nil, err
	})
	if err != nil {
		return false, err
	}
	return c.Outcome == dedup.Duplicate, nil
}

func (o *pgOutbox) ledger(ctx context.Context) (map[string]int, error) {
	rows, err := o.pool.Query(ctx, `SELECT event, count(*) FROM `+o.ledg+` GROUP BY event`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var e string
		var n int
		if err := rows.Scan(&e, &n); err != nil {
			return nil, err
		}
		out[e] = n
	}
	return out, rows.Err()
}

func (o *pgOutbox) backlog(ctx context.Context) (int, error) {
	var n int
	err := o.pool.QueryRow(ctx, `SELECT count(*) FROM `+o.s.Tables().Outbox+` WHERE published_at IS NULL`).Scan(&n)
	return n, err
}

func (o *pgOutbox) close(keep bool) {
	if !keep {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		o.pool.Exec(ctx, `DROP SCHEMA `+pgx.Identifier{o.schema}.Sanitize()+` CASCADE`)
		cancel()
	}
	o.s.Close()
	o.pool.Close()
}

// ---- SQLite ----

type sqliteOutbox struct {
	s     *sqlitestore.Store
	src   *sqlitestore.OutboxSource
	path  string
	temp  string
	topic string
}

func openSQLiteOutbox(ctx context.Context, cfg OutboxConfig, topic string) (*sqliteOutbox, error) {
	o := &sqliteOutbox{path: cfg.SQLitePath, topic: topic}
	if o.path == "" {
		dir, err := os.MkdirTemp("", "dedup-verify-outbox-")
		if err != nil {
			return nil, err
		}
		o.temp, o.path = dir, filepath.Join(dir, "outbox.db")
	}
	s, err := sqlitestore.Open(o.path)
	if err != nil {
		return nil, err
	}
	o.s = s
	if _, err := s.DB().ExecContext(ctx, `CREATE TABLE IF NOT EXISTS verify_aggregates (id TEXT PRIMARY KEY, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS verify_ledger (event TEXT NOT NULL, agg TEXT NOT NULL, version INTEGER NOT NULL)`); err != nil {
		o.close(false)
		return nil, err
	}
	if o.src, err = s.OutboxSource(ctx, cfg.Partitions); err != nil {
		o.close(false)
		return nil, err
	}
	return o, nil
}

func (o *sqliteOutbox) produce(ctx context.Context, agg, id string, hold time.Duration, commit bool) (uint64, error) {
	tx, err := o.s.DB().BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback()
	var v uint64
	if err := tx.QueryRowContext(ctx, `INSERT INTO verify_aggregates AS a VALUES (?, 1) ON CONFLICT (id) DO UPDATE SET version = a.version + 1 RETURNING version`, agg).Scan(&v); err != nil {
		return 0, err
	}
	if err := o.s.WriteOutbox(ctx, tx, event(o.topic, id, agg, v)); err != nil {
		return 0, err
	}
	if hold > 0 {
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(hold):
		}
	}
	if !commit {
		return v, tx.Rollback()
	}
	return v, tx.Commit()
}

func (o *sqliteOutbox) source() outbox.Source { return o.src }

func (o *sqliteOutbox) apply(ctx context.Context, id, agg string, v uint64) (bool, error) {
	c, err := o.s.RunInbox(ctx, dedup.Key{Scope: "verify-outbox", ID: id}, "", time.Hour, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
		_, err := tx.ExecContext(ctx, `INSERT INTO verify_ledger VALUES (?, ?, ?)`, id, agg, int64(v))
		return nil, err
	})
	if err != nil {
		return false, err
	}
	return c.Outcome == dedup.Duplicate, nil
}

func (o *sqliteOutbox) ledger(ctx context.Context) (map[string]int, error) {
	rows, err := o.s.DB().QueryContext(ctx, `SELECT event, count(*) FROM verify_ledger GROUP BY event`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var e string
		var n int
		if err := rows.Scan(&e, &n); err != nil {
			return nil, err
		}
		out[e] = n
	}
	return out, rows.Err()
}

func (o *sqliteOutbox) backlog(ctx context.Context) (int, error) {
	var n int
	err := o.s.DB().QueryRowContext(ctx, `SELECT count(*) FROM dedup_records_outbox WHERE published_at IS NULL`).Scan(&n)
	return n, err
}

func (o *sqliteOutbox) close(keep bool) {
	o.s.Close()
	if o.temp != "" && !keep {
		os.RemoveAll(o.temp)
	}
}
