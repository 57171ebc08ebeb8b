package pgstore

import (
	"context"
	"math"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5"
)

// A RetentionWindow is the row of one scope in the retention table.
type RetentionWindow struct {
	Scope string
	// Retention is the least time a completed record of the scope is
	// kept: Complete and the inbox keep a record for the longer of the
	// caller's retention and this.
	Retention time.Duration
	// ReplayHorizon is how far back the broker or client may redeliver a
	// message of this scope (a Kafka topic's retention, a dead-letter
	// queue's replay window, a client's retry window); 0 if not declared.
	ReplayHorizon time.Duration
	// UpdatedAt is when the row was last set, on the server's clock.
	UpdatedAt time.Time
}

// A RetentionWarning says that a scope's records may expire while their
// messages can still be redelivered: a redelivery after Retention and
// before ReplayHorizon is not recognised and is applied again.
type RetentionWarning struct {
	Scope         string
	Retention     time.Duration
	ReplayHorizon time.Duration
}

func (w RetentionWindow) warning() (RetentionWarning, bool) {
	if w.ReplayHorizon > 0 && w.Retention < w.ReplayHorizon {
		return RetentionWarning{Scope: w.Scope, Retention: w.Retention, ReplayHorizon: w.ReplayHorizon}, true
	}
	return RetentionWarning{}, false
}

// String says what is wrong, for a log or an alert.
func (w RetentionWarning) String() string {
	return "scope " + w.Scope + ": retention " + w.Retention.String() + " is shorter than the replay horizon " +
		w.ReplayHorizon.String() + "; a message redelivered after its record expired is applied again"
}

func (s *Store) warnRetention(ctx context.Context, w RetentionWarning) {
	s.logger().WarnContext(ctx, "dedup retention is shorter than the replay horizon: a redelivery after the record expires is applied again",
		"scope", w.Scope, "retention", w.Retention.String(), "replay_horizon", w.ReplayHorizon.String())
	if s.cfg.onRetention != nil {
		s.cfg.onRetention(ctx, w)
	}
}

// SetRetention sets the retention window of scope: completions in the
// scope are kept at least retention, and replayHorizon (0: not declared)
// is how far back a message of the scope may be redelivered. A retention
// shorter than the horizon is stored as asked, and warned about now (log
// and hook) and at every [Store.Check].
func (s *Store) SetRetention(ctx context.Context, scope string, retention, replayHorizon time.Duration) error {
	if err := (dedup.Key{Scope: scope, ID: "-"}).Validate(); err != nil {
		return err
	}
	if retention <= 0 {
		return argErr("retention", "must be positive, got "+retention.String())
	}
	if replayHorizon < 0 {
		return argErr("replay horizon", "must not be negative, got "+replayHorizon.String())
	}
	if err := s.begin(ctx, "set retention"); err != nil {
		return err
	}
	var horizon *int64
	if replayHorizon > 0 {
		h := micros(replayHorizon)
		horizon = &h
	}
	_, err := s.pool.Exec(ctx, `INSERT INTO `+s.names.retention+` (scope, retention, replay_horizon)
VALUES ($1, $2::int8 * interval '1 microsecond', $3::int8 * interval '1 microsecond')
ON CONFLICT (scope) DO UPDATE SET retention = excluded.retention, replay_horizon = excluded.replay_horizon, updated_at = statement_timestamp()`,
		scope, micros(retention), horizon)
	if err != nil {
		return s.failAuto(ctx, "set retention", err)
	}
	if w, ok := (RetentionWindow{Scope: scope, Retention: retention, ReplayHorizon: replayHorizon}).warning(); ok {
		s.warnRetention(ctx, w)
	}
	return nil
}

// DeleteRetention removes the retention window of scope; its completions
// then keep the retention their callers ask for.
func (s *Store) DeleteRetention(ctx context.Context, scope string) error {
	if err := s.begin(ctx, "delete retention"); err != nil {
		return err
	}
	if _, err := s.pool.Exec(ctx, `DELETE FROM `+s.names.retention+` WHERE scope = $1`, scope); err != nil {
		return s.failAuto(ctx, "delete retention", err)
	}
	return nil
}

// RetentionWindows returns every scope's retention window, by scope.
func (s *Store) RetentionWindows(ctx context.Context) ([]RetentionWindow, error) {
	if err := s.begin(ctx, "read retention"); err != nil {
		return nil, err
	}
	rows, err := s.pool.Query(ctx, `SELECT scope,
	(EXTRACT(EPOCH FROM retention) * 1000000)::int8,
	COALESCE((EXTRACT(EPOCH FROM replay_horizon) * 1000000)::int8, 0),
	updated_at
FROM `+s.names.retention+` ORDER BY scope`)
	if err != nil {
		return nil, s.fail(ctx, "read retention", err, true)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (RetentionWindow, error) {
		var w RetentionWindow
		var ret, hor int64
		err := r.Scan(&w.Scope, &ret, &hor, &w.UpdatedAt)
		w.Retention, w.ReplayHorizon = fromMicros(ret), fromMicros(hor)
		return w, err
	})
	if err != nil {
		return nil, s.fail(ctx, "read retention", err, true)
	}
	return out, nil
}

// fromMicros turns microseconds read from the server into a Duration,
// saturating at the longest Duration instead of overflowing (a window of
// "forever" is stored as micros(math.MaxInt64)).
func fromMicros(us int64) time.Duration {
	if us > math.MaxInt64/int64(time.Microsecond) {
		return math.MaxInt64
	}
	return time.Duration(us) * time.Microsecond
}
