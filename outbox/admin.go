package outbox

import (
	"context"
	"errors"
	"time"
)

// The operator's view of an outbox (`dedup outbox status|list|retry|drop`),
// the same for every store: pgstore and sqlitestore implement [Admin].

// Status is the state of an outbox for an operator.
type Status struct {
	Backlog     int64         `json:"backlog"`     // unpublished rows, quarantined ones excluded
	Quarantined int64         `json:"quarantined"` // rows moved aside
	Published   int64         `json:"published"`   // published rows not yet pruned
	OldestAge   time.Duration `json:"oldest_age"`  // age of the oldest unpublished row (0: none)
	// OldestTransaction is the age of the oldest transaction open in the
	// database that holds a transaction ID (PostgreSQL): its outbox rows,
	// if any, are invisible until it ends (it delays them, never loses
	// them). Always 0 on SQLite, where one writer at a time commits.
	OldestTransaction time.Duration    `json:"oldest_transaction"`
	Partitions        []PartitionState `json:"partitions"`
	Relays            []RelayState     `json:"relays"`
}

// PartitionState is one partition's backlog and lease.
type PartitionState struct {
	Partition int           `json:"partition"`
	Backlog   int64         `json:"backlog"`
	OldestAge time.Duration `json:"oldest_age"` // the partition's lag
	Owner     string        `json:"owner"`      // "" when free
	Epoch     int64         `json:"epoch"`
	LeaseLeft time.Duration `json:"lease_left"` // <= 0: expired
}

// RelayState is one relay that joined.
type RelayState struct {
	Relay      string        `json:"relay"`
	Partitions int           `json:"partitions"`
	Alive      bool          `json:"alive"`
	Since      time.Duration `json:"since"` // time since it started (0: not recorded)
}

// Row is one outbox row for `dedup outbox list`.
type Row struct {
	Seq         int64      `json:"seq"`
	ID          string     `json:"id"`
	Key         string     `json:"key"`
	Topic       string     `json:"topic"`
	Attempts    int        `json:"attempts"`
	LastError   string     `json:"last_error,omitempty"`
	CreatedAt   time.Time  `json:"created_at"`
	Quarantined *time.Time `json:"quarantined_at,omitempty"`
	Published   *time.Time `json:"published_at,omitempty"`
}

// ErrNoQuarantinedRow is returned by [Admin.OutboxRetry] and
// [Admin.OutboxDrop] when no quarantined row has the message ID.
var ErrNoQuarantinedRow = errors.New("no quarantined outbox row with that message ID")

// Admin is what an operator does to an outbox table.
type Admin interface {
	// OutboxStatus reads the backlog, the quarantine and the leases with
	// partitions partitions (the relays' N).
	OutboxStatus(ctx context.Context, partitions int) (Status, error)
	// OutboxList returns up to limit rows in Seq order: the quarantined
	// ones when quarantined is true, else the unpublished ones in line.
	OutboxList(ctx context.Context, quarantined bool, limit int) ([]Row, error)
	// OutboxRetry puts the quarantined row of message id back in line
	// (attempts restart at 0; its key's later rows wait behind it again).
	OutboxRetry(ctx context.Context, id string) (Row, error)
	// OutboxDrop deletes the quarantined row of message id, so that its
	// key's later rows flow (a row in line is never dropped); with dryRun
	// it returns the row and changes nothing.
	OutboxDrop(ctx context.Context, id string, dryRun bool) (Row, error)
}
