package pgstore

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
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

	// started, when set (by tests), runs first in a run's goroutine.
	started func()
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
	if v.pending.Add(int64(n)) < max(v.min, v.need.Load()) || !s.poolSpares(2) || !v.running.CompareAndSwap(false, true) {
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

// poolSpares reports whether the pool has n connections it can give
// (idle, or yet to be opened): before a run, one for the run and still
// one for the callers. A run holds its connection until the VACUUM ends,
// and must not leave claims waiting in the pool for it. When it has none,
// the completions stay pending and a later one tries again.
func (s *Store) poolSpares(n int64) bool {
	st := s.pool.Stat()
	return int64(st.IdleConns())+int64(st.MaxConns())-int64(st.TotalConns()) >= n
}

// vacuum runs VACUUM on the records table if the completions pending are
// at least the option's fraction of its estimated rows (pg_class.reltuples,
// which vacuum and analyze keep up to date).
func (s *Store) vacuum() {
	v := &s.vac
	defer v.wg.Done()
	defer v.running.Store(false)
	ctx := v.ctx
	if v.started != nil {
		v.started()
	}
	// The run takes its connection first and looks at the pool with it
	// taken: completed's look at the pool is older, and a caller may
	// have taken the connection it saw to spare since (then the run
	// would take the last one). The completions stay pending.
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		if ctx.Err() == nil {
			s.logger().WarnContext(ctx, "dedup records vacuum: no connection", "table", s.names.records, "error", err)
		}
		return
	}
	if !s.poolSpares(1) {
		conn.Release()
		return
	}
	pending := v.pending.Load()
	var rows float64
	var may bool
	if err := conn.QueryRow(ctx, vacuumCheck, s.names.records).Scan(&rows, &may); err != nil {
		conn.Release()
		if ctx.Err() == nil {
			s.logger().WarnContext(ctx, "dedup records vacuum: reading the table's size failed", "table", s.names.records, "error", err)
		}
		return
	}
	if !may {
		// The server would skip the table with a WARNING in its log on
		// every run: say so once here and stop.
		conn.Release()
		v.denied.Store(true)
		s.logger().WarnContext(ctx, "dedup records vacuum: the store's role may not vacuum the table (it is not its owner, nor the database's, nor granted MAINTAIN); the store will not run VACUUM (WithVacuum(0, 0) turns this off)", "table", s.names.records)
		return
	}
	if need := v.fraction * rows; float64(pending) < need {
		// Not yet: look again once that many are pending (at most
		// one read of the size per run of the table's growth).
		v.need.Store(int64(min(need, 1<<62)))
		conn.Release()
		return
	}
	v.pending.Add(-pending)
	v.need.Store(0) // the run updates reltuples: read it again next time
	v.runs.Add(1)
	// SKIP_LOCKED: a vacuum already at work on the table (autovacuum,
	// another store's) or a lock held by DDL makes this one skip at once
	// instead of queueing. TRUNCATE false: the run never takes the
	// exclusive lock that cutting empty pages off the table's end needs
	// (brief, but it would stall claims, and on a hot standby cancel
	// queries, as often as the store vacuums); autovacuum still truncates.
	yielded, err := s.runVacuum(ctx, conn)
	switch {
	case ctx.Err() != nil:
	case yielded:
		s.logger().InfoContext(ctx, "dedup records vacuum cancelled: it blocked a lock request on the table", "table", s.names.records)
	case err != nil:
		s.logger().WarnContext(ctx, "dedup records vacuum failed", "table", s.names.records, "error", err)
	}
}

// vacuumCancelWait bounds how long a run waits for the server to stop its
// VACUUM after Close sent it a cancel request, before it drops the
// connection instead (the server then goes on until the VACUUM ends).
const vacuumCancelWait = 5 * time.Second

// vacuumYieldCheck is how often a run looks for sessions waiting for a
// lock its VACUUM holds (PostgreSQL's deadlock_timeout, after which the
// server cancels an autovacuum that blocks a lock request, is 1s by
// default).
const vacuumYieldCheck = time.Second

// runVacuum sends the VACUUM on conn, the run's connection from the
// pool, which it gives back (or closes).
// When ctx is cancelled (Close) it stops the VACUUM on the server with a
// cancel request and waits for the server's answer: a plain cancelled
// context would only close the connection (pgx's default), and the server,
// which does not look at the socket while it vacuums, would go on with the
// table's lock held after Close returned. A connection a cancel request
// was sent on is closed, not given back: a request that arrives late must
// not cancel another caller's statement.
//
// The server cancels an autovacuum that blocks another session's lock
// request, but not a VACUUM a client sent: DDL on the table (a migration,
// an index build) would queue behind the store's VACUUM, and every claim
// behind the DDL, until the VACUUM ends. So the run looks every
// vacuumYieldCheck for a session its VACUUM blocks and, if it finds one,
// cancels the VACUUM as the server would an autovacuum's (yielded).
func (s *Store) runVacuum(ctx context.Context, conn *pgxpool.Conn) (yielded bool, err error) {
	pid := conn.Conn().PgConn().PID()
	rctx, rcancel := context.WithCancel(ctx)
	defer rcancel()
	var yield atomic.Bool
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		tick := time.NewTicker(vacuumYieldCheck)
		defer tick.Stop()
		for {
			select {
			case <-rctx.Done():
				return
			case <-tick.C:
			}
			if s.vacuumBlocks(rctx, pid) {
				yield.Store(true)
				rcancel()
				return
			}
		}
	}()
	defer func() { <-watched }()
	xctx, xcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer xcancel()
	sent := make(chan struct{})
	stop := context.AfterFunc(rctx, func() {
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
	_, err = conn.Exec(xctx, `VACUUM (SKIP_LOCKED, TRUNCATE false) `+s.names.records)
	if stop() {
		rcancel() // stop the watch
		conn.Release()
		return false, err
	}
	xcancel() // the Exec is over: let the func above return
	<-sent
	c := conn.Hijack()
	cctx, cancel := context.WithTimeout(context.Background(), vacuumCancelWait)
	defer cancel()
	c.Close(cctx)
	return yield.Load() && ctx.Err() == nil, err
}

// vacuumBlocks reports whether a session waits for a lock that the
// backend pid holds (pg_locks, which every role sees whole, unlike
// pg_stat_activity's wait events of other roles' sessions). It gives up (false) when no pool connection is free
// within vacuumYieldCheck: the watch must not queue for long with the
// callers.
func (s *Store) vacuumBlocks(ctx context.Context, pid uint32) bool {
	ctx, cancel := context.WithTimeout(ctx, vacuumYieldCheck)
	defer cancel()
	var blocks bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted AND $1::int = ANY (pg_blocking_pids(pid)))`, int64(pid)).Scan(&blocks)
	return err == nil && blocks
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
