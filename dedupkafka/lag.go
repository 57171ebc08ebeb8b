package dedupkafka

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/twmb/franz-go/pkg/kadm"
)

// Lag is how far the consumer group is behind on its topics, as the
// brokers report it: per partition, the end offset minus the group's
// committed offset (from the log start where nothing is committed yet).
// The adapter commits an offset only past records whose decision was
// final, so a record being processed or held for a retry counts as lag.
type Lag struct {
	// Total sums the lag of every partition of the consumer's topics.
	Total int64
	// Partitions holds the lag of each partition, by topic.
	Partitions map[string]map[int32]int64
}

// Lag asks the brokers for the group's lag on the consumer's topics: a
// describe, an offset fetch and a list of end offsets, so call it at a
// scrape, not per record. A partition whose offsets could not be read
// makes it fail.
func (c *Consumer) Lag(ctx context.Context) (Lag, error) {
	lags, err := kadm.NewClient(c.cl).Lag(ctx, c.group)
	if err != nil {
		return Lag{}, fmt.Errorf("dedupkafka: lag of group %s: %w", c.group, err)
	}
	gl, ok := lags[c.group]
	if !ok {
		return Lag{}, fmt.Errorf("dedupkafka: lag of group %s: not in the brokers' answer", c.group)
	}
	if err := gl.Error(); err != nil {
		return Lag{}, fmt.Errorf("dedupkafka: lag of group %s: %w", c.group, err)
	}
	out := Lag{Partitions: map[string]map[int32]int64{}}
	var errs []error
	for topic, parts := range gl.Lag {
		if !slices.Contains(c.topics, topic) {
			continue
		}
		m := make(map[int32]int64, len(parts))
		for p, l := range parts {
			if l.Err != nil {
				errs = append(errs, fmt.Errorf("%s[%d]: %w", topic, p, l.Err))
				continue
			}
			m[p] = l.Lag
			out.Total += l.Lag
		}
		out.Partitions[topic] = m
	}
	if err := errors.Join(errs...); err != nil {
		return out, fmt.Errorf("dedupkafka: lag of group %s: %w", c.group, err)
	}
	return out, nil
}
