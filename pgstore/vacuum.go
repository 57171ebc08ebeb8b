package pgstore

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// vacuumer runs VACUUM on the plain records table once enough records
// have been completed through the store since its last run (see
// [WithVacuum] for why). It belongs to its Store: Close cancels a run in
// flight and waits for it.
type vacuumer struct {
	min      int64   // completions before the store looks at the table; 0: off
	fraction float64 // of the table's estimated rows

	pending atomic.Int64 // completions since the last run
	need    atomic.Int64 // pending that makes the store look again: min, or the last size read
	running atomic.Bool  // a run (or its decision) is in flight
	denied  atomic.Bool  // the role may not vacuum the table: no more runs
	runs    atomic.Int64 // VACUUMs sent, for tests

	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// completed notes n records completed (a completion writes a new version
// of each, leaving the claim's version dead) and starts a run in the
// background when at least the option's minimum are pending and none is in
// flight. The run decides against the table's size.
func (s *Store) completed(n int) {
	v := &s.vac
	if v.min == 0 || n <= 0 || v.denied.Load() {
		return
	}
	if v.pending.Add(int64(n)) < max(v.min, v.need.Load()) || !v.running.CompareAndSwap(false, true) {
		return
	}
	s.mu.Lock()
	if s.closed.Load() {
		s.mu.Unlock()
		v.running.Store(false)
		return
	}
	v.wg.Add(1)
	s.mu.Unlock()
	go s.vacuum()
}

// vacuum runs VACUUM on the records table if the completions pending are
// at least the option's fraction of its estimated rows (pg_class.reltuples,
// which vacuum and analyze keep up to date).
func (s *Store) vacuum() {
	v := &s.vac
	defer v.wg.Done()
	defer v.running.Store(false)
	ctx := v.ctx
	pending := v.pending.Load()
	var rows float64
	var may bool
	if err := s.pool.QueryRow(ctx, vacuumCheck, s.names.records).Scan(&rows, &may); err != nil {
		if ctx.Err() == nil {
			s.logger().WarnContext(ctx, "dedup records vacuum: reading the table's size failed", "table", s.names.records, "error", err)
		}
		return
	}
	if !may {
		// The server would skip the table with a WARNING in its log on
		// every run: say so once here and stop.
		v.denied.Store(true)
		s.logger().WarnContext(ctx, "dedup records vacuum: the store's role may not vacuum the table (it is not its owner, nor the database's, nor granted MAINTAIN); the store will not run VACUUM (WithVacuum(0, 0) turns this off)", "table", s.names.records)
		return
	}
	if need := v.fraction * rows; float64(pending) < need {
		// Not yet: look again once that many are pending (at most
		// one read of the size per run of the table's growth).
		v.need.Store(int64(min(need, 1<<62)))
		return
	}
	v.pending.Add(-pending)
	v.need.Store(0) // the run updates reltuples: read it again next time
	v.runs.Add(1)
	// SKIP_LOCKED: a vacuum already at work on the table (autovacuum,
	// another store's) or a lock held by DDL makes this one skip at once
	// instead of queueing. A role that does not own the table gets a
	// warning from the server and nothing is done.
	if err := s.runVacuum(ctx); err != nil && ctx.Err() == nil {
		s.logger().WarnContext(ctx, "dedup records vacuum failed", "table", s.names.records, "error", err)
	}
}

// vacuumCancelWait bounds how long a run waits for the server to stop its
// VACUUM after Close sent it a cancel request, before it drops the
// connection instead (the server then goes on until the VACUUM ends).
const vacuumCancelWait = 5 * time.Second

// runVacuum sends the VACUUM on a connection of its own from the pool.
// When ctx is cancelled (Close) it stops the VACUUM on the server with a
// cancel request and waits for the server's answer: a plain cancelled
// context would only close the connection (pgx's default), and the server,
// which does not look at the socket while it vacuums, would go on with the
// table's lock held after Close returned. A connection a cancel request
// was sent on is closed, not given back: a request that arrives late must
// not cancel another caller's statement.
func (s *Store) runVacuum(ctx context.Context) error {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	xctx, xcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer xcancel()
	sent := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(sent)
		cctx, cancel := context.WithTimeout(context.Background(), vacuumCancelWait)
		defer cancel()
		if conn.Conn().PgConn().CancelRequest(cctx) != nil {
			xcancel() // no request went: drop the connection now
			return
		}
		t := time.AfterFunc(vacuumCancelWait, xcancel)
		<-xctx.Done()
		t.Stop()
	})
	_, err = conn.Exec(xctx, `VACUUM (SKIP_LOCKED) `+s.names.records)
	if stop() {
		conn.Release()
		return err
	}
	xcancel() // the Exec is over: let the func above return
	<-sent
	c := conn.Hijack()
	cctx, cancel := context.WithTimeout(context.Background(), vacuumCancelWait)
	defer cancel()
	c.Close(cctx)
	return err
}

// vacuumCheck reads the records table's estimated rows and whether the
// current role may vacuum it: it owns the table or the database (through a
// role it has the privileges of, or as superuser), or, from PostgreSQL 17,
// has the MAINTAIN privilege on it (the CASE keeps the privilege name from
// older servers, which do not know it).
const vacuumCheck = `SELECT c.reltuples,
	pg_has_role(c.relowner, 'USAGE')
	OR pg_has_role(d.datdba, 'USAGE')
	OR CASE WHEN current_setting('server_version_num')::int >= 170000 THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END
FROM pg_class c, pg_database d
WHERE c.oid = $1::regclass AND d.datname = current_database()`

// closeVacuum cancels a run in flight and waits for it. The caller has
// set s.closed, so no run starts after it takes s.mu.
func (s *Store) closeVacuum() {
	if s.vac.cancel == nil {
		return
	}
	s.mu.Lock()
	s.mu.Unlock() //nolint:staticcheck // a barrier: completed() checks closed under s.mu
	s.vac.cancel()
	s.vac.wg.Wait()
}
