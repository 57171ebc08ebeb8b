package verify

import (
	"fmt"
	"time"
)

// Report is the outcome of one run. Its JSON form is the output of
// `dedup verify --json`.
type Report struct {
	// What ran.
	Store string `json:"store"`
	// Broker is "simulated" (in process), "nats" (a real JetStream
	// server) or "rabbitmq", and Stream the run's JetStream stream or
	// RabbitMQ queue.
	Broker    string  `json:"broker"`
	Stream    string  `json:"stream,omitempty"`
	Mode      Mode    `json:"mode"`
	Messages  int     `json:"messages"`
	Consumers int     `json:"consumers"`
	DupRate   float64 `json:"dup_rate"`
	CrashRate float64 `json:"crash_rate"`
	FailRate  float64 `json:"fail_rate"`
	Lease     string  `json:"lease"`
	Seed      uint64  `json:"seed"`
	// Path is the database file, when the store has one and it is kept.
	Path string `json:"path,omitempty"`

	// What the broker and the consumers did.
	Deliveries          int `json:"deliveries"`
	BrokerDuplicates    int `json:"broker_duplicates"`
	Redeliveries        int `json:"redeliveries"`
	Effects             int `json:"effects"`
	DuplicatesSkipped   int `json:"duplicates_skipped"`
	CrashesBeforeCommit int `json:"crashes_before_commit"`
	CrashesAfterCommit  int `json:"crashes_after_commit"`
	Takeovers           int `json:"takeovers"`
	HandlerFailures     int `json:"handler_failures"`
	InProgressNacks     int `json:"in_progress_nacks"`
	StoreErrors         int `json:"store_errors"`
	LeasesLost          int `json:"leases_lost"`
	Conflicts           int `json:"conflicts"`
	// Layers counts the duplicates each layer of a layered target caught
	// (window, bloom, the fast store, the durable store), and Flushes the
	// fast-store flushes injected; empty for other targets.
	Layers  map[string]int64 `json:"layers,omitempty"`
	Flushes int              `json:"flushes,omitempty"`
	// Processes is the number of consumer processes of RunProcesses (each
	// with Consumers goroutines), 0 for a run in one process.
	// ProcessKills counts the worker processes SIGKILLed mid-run,
	// ProcessStarts the worker processes started (the first ones and
	// every restart), and KilledDeliveries the deliveries in flight on a
	// killed process, which the broker redelivered after its visibility
	// timeout.
	Processes        int `json:"processes,omitempty"`
	ProcessKills     int `json:"process_kills,omitempty"`
	ProcessStarts    int `json:"process_starts,omitempty"`
	KilledDeliveries int `json:"killed_deliveries,omitempty"`
	// Failovers counts the manual failovers (CLUSTER FAILOVER on a
	// replica) and MasterKills the masters SIGKILLed, promoted over and
	// restarted as replicas, that Config.Failover did mid-run;
	// FailoverErrors the steps that failed (the first in FailoverError),
	// which fail the run: it did not test what it says.
	Failovers      int    `json:"failovers,omitempty"`
	MasterKills    int    `json:"master_kills,omitempty"`
	FailoverErrors int    `json:"failover_errors,omitempty"`
	FailoverError  string `json:"failover_error,omitempty"`
	// FailoverEvery is Config.FailoverEvery of a run that failed its
	// store over (0: none).
	FailoverEvery int `json:"failover_every,omitempty"`
	// ConnectionDrops counts the broker connections cut mid-run
	// (RunAMQP's DropEvery).
	ConnectionDrops int `json:"connection_drops,omitempty"`
	// SkippedPolls counts polls (RunKafka) that did not start where the
	// member's previous poll of the partition ended: records the harness
	// would have passed over without running. The member reads the
	// partition again from its committed offset, but the run fails: the
	// harness's model of the consumer is broken and its verdict cannot be
	// trusted.
	SkippedPolls int `json:"skipped_polls,omitempty"`
	// SlowestDeliveryMS is the longest a consumer spent on one delivery,
	// in milliseconds. In lease mode a delivery slower than the lease can
	// be taken over while it works.
	SlowestDeliveryMS float64 `json:"slowest_delivery_ms"`
	// FirstError is the first store error, lost lease or conflict, if any.
	FirstError string `json:"first_error,omitempty"`

	// The verdict of the ledger.
	Lost          int `json:"lost"`
	DoubleApplied int `json:"double_applied"`
	// KillWindowDoubles counts, in lease mode with several processes,
	// the double-applied messages whose every extra effect was written by
	// a process that was SIGKILLed with that message in flight: it applied
	// the effect and died before Complete, and the take-over applied it
	// again. That is lease mode's documented open window, shown rather
	// than hidden; they are still counted in DoubleApplied.
	KillWindowDoubles int `json:"kill_window_doubles,omitempty"`
	// Unfinished counts messages with a delivery still unacknowledged when
	// the run stopped early; 0 after a complete run.
	Unfinished int `json:"unfinished"`
	// StrayEffects counts ledger rows of this run whose message ID was
	// never published.
	StrayEffects int      `json:"stray_effects"`
	LostSample   []string `json:"lost_sample,omitempty"`
	DoubleSample []string `json:"double_applied_sample,omitempty"`
	TimedOut     bool     `json:"timed_out"`
	Interrupted  bool     `json:"interrupted"`

	Seconds float64 `json:"seconds"`
	// Throughput is messages per second.
	Throughput float64 `json:"throughput"`
	// OK is true when every message was applied exactly once and the run
	// finished.
	OK bool `json:"ok"`
}

// sampleSize bounds LostSample and DoubleSample.
const sampleSize = 5

// Violations lists what went wrong, in words; empty when OK.
func (r *Report) Violations() []string {
	var v []string
	if r.Lost > 0 {
		v = append(v, fmt.Sprintf("%d messages lost (acknowledged, never applied)", r.Lost))
	}
	if r.DoubleApplied > 0 {
		v = append(v, fmt.Sprintf("%d messages applied more than once", r.DoubleApplied))
	}
	if r.StrayEffects > 0 {
		v = append(v, fmt.Sprintf("%d ledger rows for messages never published", r.StrayEffects))
	}
	if r.SkippedPolls > 0 {
		v = append(v, fmt.Sprintf("%d Kafka polls skipped offsets (a harness fault: the verdict cannot be trusted)", r.SkippedPolls))
	}
	if r.Conflicts > 0 {
		v = append(v, fmt.Sprintf("%d fingerprint conflicts on identical copies", r.Conflicts))
	}
	if r.FailoverErrors > 0 {
		v = append(v, fmt.Sprintf("%d failover steps failed (first: %s)", r.FailoverErrors, r.FailoverError))
	} else if r.FailoverEvery > 0 && r.Failovers+r.MasterKills == 0 {
		v = append(v, "no failover happened during the run (lower --failover-every or raise --messages)")
	}
	if r.TimedOut {
		v = append(v, fmt.Sprintf("timed out with %d messages unfinished", r.Unfinished))
	} else if r.Interrupted {
		v = append(v, fmt.Sprintf("interrupted with %d messages unfinished", r.Unfinished))
	} else if r.Unfinished > 0 {
		v = append(v, fmt.Sprintf("%d messages unfinished", r.Unfinished))
	}
	return v
}

func (r *Report) finish(elapsed time.Duration) {
	r.Seconds = elapsed.Seconds()
	if r.Seconds > 0 {
		r.Throughput = float64(r.Messages-r.Unfinished) / r.Seconds
	}
	r.OK = len(r.Violations()) == 0
}
