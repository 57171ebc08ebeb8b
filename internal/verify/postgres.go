package verify

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultPostgresURL is the database verify uses without --addr or
// $DEDUP_POSTGRES_URL.
const DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// postgresConns is the pool size when the connection string sets none:
// enough for the consumers of a run to work at once, well under a default
// server's 100 connections.
const postgresConns = 16

// openPostgres opens the PostgreSQL store in a schema of its own for this
// run (dedup_verify_<random>), migrates it and, in inbox mode, creates the
// ledger table next to the dedup tables so that both are written in one
// transaction. Close drops the schema unless o.Keep, in which case the
// summary names it for inspection.
func openPostgres(ctx context.Context, o OpenOptions) (Target, error) {
	url := o.Addr
	if url == "" {
		url = os.Getenv("DEDUP_POSTGRES_URL")
	}
	if url == "" {
		url = DefaultPostgresURL
	}
	cfg, err := pgstore.ParsePoolConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse the connection string: %w (set --addr or DEDUP_POSTGRES_URL)", err)
	}
	if !strings.Contains(url, "pool_max_conns") {
		cfg.MaxConns = postgresConns
		if o.Attach {
			// One of several processes: keep the sum well under the
			// server's connection limit.
			cfg.MaxConns = postgresConns / 2
		}
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
		if err != nil {
			pool.Close()
		}
	}
	if err != nil {
		return nil, fmt.Errorf("%w (is PostgreSQL running at %s:%d? set --addr or DEDUP_POSTGRES_URL)", err, cfg.ConnConfig.Host, cfg.ConnConfig.Port)
	}
	schema := o.Schema
	if schema == "" {
		schema = fmt.Sprintf("dedup_verify_%012x", rand.Uint64()>>16)
	}
	// An attached process leaves the schema to the process that made it.
	t := &pgTarget{pool: pool, schema: schema, keep: o.Keep || o.Attach}
	s, err := pgstore.New(pool, pgstore.WithSchema(schema))
	if err == nil && !o.Attach {
		_, err = s.Migrate(ctx)
	}
	if err == nil {
		switch o.Mode {
		case InboxMode, ApplyMode:
			t.ledger = pgx.Identifier{schema, "ledger"}.Sanitize()
			if !o.Attach {
				_, err = pool.Exec(ctx, `CREATE TABLE `+t.ledger+` (msg_id text COLLATE "C" NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())`)
			}
			t.Target = &pgInboxTarget{store: s, ledger: t.ledger, mode: o.Mode}
		case LeaseMode:
			t.Target, err = newLeaseTarget("postgres", s, o)
		default:
			err = fmt.Errorf("the postgres store has no mode %q", o.Mode)
		}
	}
	if err != nil {
		t.keep = o.Attach
		return nil, errors.Join(err, t.drop())
	}
	return t, nil
}

// pgTarget is a target whose tables live in a schema of their own.
type pgTarget struct {
	Target
	pool   *pgxpool.Pool
	schema string
	ledger string // set in inbox mode
	keep   bool
}

// Path names where the tables are, for the summary of a kept run.
func (t *pgTarget) Path() string {
	where := "PostgreSQL schema " + t.schema + " (dedup tables dedup_rec, dedup_scopes, dedup_retention, dedup_outbox"
	if t.ledger != "" {
		where += "; ledger table ledger"
	}
	return where + "; drop it with DROP SCHEMA " + t.schema + " CASCADE)"
}

// LayerStats passes on the layer counts of a layered target.
func (t *pgTarget) LayerStats() (map[string]int64, int) {
	if ls, ok := t.Target.(LayerReporter); ok {
		return ls.LayerStats()
	}
	return nil, 0
}

// Close closes the store and drops the run's schema unless it is kept.
func (t *pgTarget) Close() error {
	var err error
	if t.Target != nil {
		err = t.Target.Close()
	}
	return errors.Join(err, t.drop())
}

func (t *pgTarget) drop() error {
	defer t.pool.Close()
	if t.keep {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := t.pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{t.schema}.Sanitize()+` CASCADE`); err != nil {
		return fmt.Errorf("drop the run's schema %s: %w", t.schema, err)
	}
	return nil
}

// pgInboxTarget runs pgstore in inbox or apply mode: the ledger row is
// inserted in the inbox transaction, so the dedup record and the effect
// commit together or not at all. Faults are injected as in [InboxTarget];
// in apply mode, where the handler only queues the ledger insert, a
// handler failure happens before anything is sent, and a crash before the
// commit is a statement after the insert that fails, so that the server
// rolls the pipeline back as it does when the consumer dies mid-pipeline.
type pgInboxTarget struct {
	store  *pgstore.Store
	ledger string
	mode   Mode
}

// Store returns "postgres".
func (t *pgInboxTarget) Store() string { return "postgres" }

// Mode returns InboxMode or ApplyMode.
func (t *pgInboxTarget) Mode() Mode { return t.mode }

// errCrashSQL is the statement that stands for a consumer dying before its
// pipeline commits.
const errCrashSQL = `SELECT ('verify: consumer crashed before the commit: ' || pg_backend_pid())::int`

// Apply runs one delivery through the store's inbox.
func (t *pgInboxTarget) Apply(ctx context.Context, d Delivery) Result {
	if t.mode == ApplyMode {
		return t.pipelined(ctx, d)
	}
	c, err := t.runInbox(ctx, d)
	return inboxResult(c, err, d)
}

// runInbox runs one delivery in the store's inbox transaction: the ledger
// insert, with the delivery's fault.
func (t *pgInboxTarget) runInbox(ctx context.Context, d Delivery) (dedup.Claim, error) {
	return t.store.RunInbox(ctx, d.Key, d.Fingerprint, retention, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if d.Fault == HandlerFailure {
			return nil, errHandler
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+t.ledger+` (msg_id) VALUES ($1)`, d.MsgID); err != nil {
			return nil, err
		}
		if d.Fault == CrashBeforeCommit {
			return nil, errCrash
		}
		return nil, nil
	})
}

// pipelined runs one delivery through Store.Apply.
func (t *pgInboxTarget) pipelined(ctx context.Context, d Delivery) Result {
	if d.Fault == HandlerFailure {
		return inboxResult(dedup.Claim{}, errHandler, d)
	}
	var w pgx.Batch
	w.Queue(`INSERT INTO `+t.ledger+` (msg_id) VALUES ($1)`, d.MsgID)
	if d.Fault == CrashBeforeCommit {
		w.Queue(errCrashSQL)
	}
	c, err := t.store.Apply(ctx, d.Key, d.Fingerprint, retention, nil, &w)
	if d.Fault == CrashBeforeCommit && err != nil && strings.Contains(err.Error(), "verify: consumer crashed") {
		err = errCrash
	}
	return inboxResult(c, err, d)
}

// inboxResult is the Result of an inbox call that returned c and err.
func inboxResult(c dedup.Claim, err error, d Delivery) Result {
	r := Result{TakenOver: c.TakenOver}
	switch {
	case errors.Is(err, errCrash):
		r.Outcome = CrashedBeforeCommit
	case errors.Is(err, errHandler):
		r.Outcome = HandlerFailed
	case err != nil:
		r.Outcome, r.Err = StoreFailed, err
	case c.Outcome == dedup.Acquired && d.Fault == CrashAfterCommit:
		r.Outcome = CrashedAfterCommit
	case c.Outcome == dedup.Acquired:
		r.Outcome = Applied
	case c.Outcome == dedup.Duplicate:
		r.Outcome = Duplicate
	case c.Outcome == dedup.InProgress:
		r.Outcome, r.RetryAfter = InProgress, time.Until(c.LeaseUntil)
	case c.Outcome == dedup.Mismatch:
		r.Outcome, r.Err = Conflict, dedup.ErrFingerprintMismatch
	default:
		r.Outcome, r.Err = StoreFailed, fmt.Errorf("inbox returned outcome %v", c.Outcome)
	}
	return r
}

// Effects counts the ledger rows per message ID.
func (t *pgInboxTarget) Effects(ctx context.Context, prefix string) (map[string]int, error) {
	// A range scan instead of LIKE, so no character of prefix is special.
	rows, err := t.store.Pool().Query(ctx, `SELECT msg_id, count(*) FROM `+t.ledger+` WHERE msg_id >= $1 AND msg_id < $2 GROUP BY msg_id`,
		prefix, prefix+"\U0010FFFF")
	if err != nil {
		return nil, fmt.Errorf("read ledger: %w", err)
	}
	out := map[string]int{}
	var id string
	var n int
	_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error { out[id] = n; return nil })
	if err != nil {
		return nil, fmt.Errorf("read ledger: %w", err)
	}
	return out, nil
}

// Close closes the store (the pool and the schema are the pgTarget's).
func (t *pgInboxTarget) Close() error { return t.store.Close() }
