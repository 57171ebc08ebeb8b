package verify

import (
	"context"
	"fmt"
	"math"
	"time"
)

// Limits on Config values.
const (
	MaxConsumers = 10000
	MaxMessages  = 100_000_000
)

// Config says what one run does. Its error messages name the command line
// flag of each field (Messages is --messages).
type Config struct {
	// Messages is how many distinct messages the broker publishes.
	Messages int
	// Consumers is how many goroutines consume deliveries at once.
	Consumers int
	// DupRate is the probability that the broker queues a second copy of a
	// message right behind the first, so two consumers race on one key.
	DupRate float64
	// CrashRate is the probability that a delivery crashes its consumer:
	// half of the crashes happen before the commit, half after the commit
	// and before the ack.
	CrashRate float64
	// FailRate is the probability that the handler returns an error
	// before its effect, so the claim is released and the message retried.
	FailRate float64
	// Lease is the claim lease in lease mode. It also sets the broker's
	// delays: a crashed delivery reappears after the visibility timeout of
	// Lease/2 to Lease, a negatively acknowledged one after Lease/20 to
	// Lease/10 (or when the blocking lease ends).
	Lease time.Duration
	// Seed seeds the broker's choices (copies, faults, delays); 0 picks a
	// random seed, which the report shows. The same seed makes the same
	// choices in the same order, but goroutine scheduling still varies.
	Seed uint64
	// Progress, if set, is called about every ProgressEvery while the run
	// goes on, from the broker's goroutine: it must return quickly.
	Progress func(Progress)
	// ProgressEvery defaults to 100ms.
	ProgressEvery time.Duration
	// Failover, if set, is called every FailoverEvery deliveries on a
	// goroutine of its own, one call at a time (a call still under way
	// when the next is due is not doubled up), to fail the store's
	// servers over mid-run: [ClusterFailover.Step]. The run waits for a
	// call under way before it reads the ledger. Simulated broker only
	// ([Run] and [RunProcesses]).
	Failover func(ctx context.Context) (FailoverKind, string, error)
	// FailoverEvery is the number of deliveries between Failover calls.
	FailoverEvery int
}

// DefaultConfig returns the configuration of `dedup verify` without flags.
func DefaultConfig() Config {
	return Config{
		Messages:  20000,
		Consumers: 8,
		DupRate:   0.2,
		CrashRate: 0.02,
		FailRate:  0.02,
		Lease:     200 * time.Millisecond,
	}
}

// Progress is a snapshot of a run for a progress display.
type Progress struct {
	// Done counts messages whose every delivery has been acknowledged.
	Done     int
	Messages int
	// Deliveries counts deliveries handed to consumers so far.
	Deliveries int
	Elapsed    time.Duration
}

// Validate reports the first invalid field, naming its flag.
func (c *Config) Validate() error {
	switch {
	case c.Messages < 1 || c.Messages > MaxMessages:
		return fmt.Errorf("--messages must be between 1 and %d, got %d", MaxMessages, c.Messages)
	case c.Consumers < 1 || c.Consumers > MaxConsumers:
		return fmt.Errorf("--consumers must be between 1 and %d, got %d", MaxConsumers, c.Consumers)
	}
	for _, r := range []struct {
		flag string
		v    float64
	}{{"--dup-rate", c.DupRate}, {"--crash-rate", c.CrashRate}, {"--fail-rate", c.FailRate}} {
		if math.IsNaN(r.v) || r.v < 0 || r.v > 1 {
			return fmt.Errorf("%s must be a probability between 0 and 1, got %v", r.flag, r.v)
		}
	}
	if c.CrashRate+c.FailRate >= 1 {
		return fmt.Errorf("--crash-rate plus --fail-rate must be below 1, got %v: at 1 no delivery is ever acknowledged", c.CrashRate+c.FailRate)
	}
	if c.Lease < time.Millisecond {
		return fmt.Errorf("--lease must be at least 1ms, got %v", c.Lease)
	}
	if c.FailoverEvery < 0 || c.Failover != nil && c.FailoverEvery == 0 {
		return fmt.Errorf("--failover-every must be a count of deliveries >= 1, got %d", c.FailoverEvery)
	}
	if c.ProgressEvery < 0 {
		return fmt.Errorf("progress interval must not be negative, got %v", c.ProgressEvery)
	}
	return nil
}
