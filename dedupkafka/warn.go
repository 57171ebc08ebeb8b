package dedupkafka

import (
	"context"
	"log/slog"
	"strconv"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
)

// WarningKind names a start-up warning.
type WarningKind uint8

const (
	// TopicOutlivesDedup: the topic keeps records (retention.ms, -1 for
	// ever) longer than the processor remembers keys, so an offset reset
	// or a replay from the start reads records whose dedup record has
	// expired: they are applied again.
	TopicOutlivesDedup WarningKind = iota + 1
	// OffsetsExpire: an idle group's committed offsets expire after the
	// broker's offsets.retention.minutes, and the group then starts from
	// its reset offset (the earliest, by default), reading again records
	// older than the dedup retention. Raised when the offset retention is
	// shorter than the topic's retention and the topic outlives the dedup
	// retention.
	OffsetsExpire
	// ReplayOutlivesDedup: the replay horizon given with
	// [WithReplayHorizon] is longer than the dedup retention.
	ReplayOutlivesDedup
	// ConfigNotChecked: the retention settings could not be read (no
	// DescribeConfigs permission, a broker that does not answer).
	ConfigNotChecked
)

func (k WarningKind) String() string {
	switch k {
	case TopicOutlivesDedup:
		return "topic retention is longer than the dedup retention: a replay from further back applies records again"
	case OffsetsExpire:
		return "committed offsets expire before the topic's records: an idle group restarts from the reset offset, further back than dedup remembers"
	case ReplayOutlivesDedup:
		return "replay horizon is longer than the dedup retention"
	case ConfigNotChecked:
		return "retention settings not checked"
	}
	return "warning(?)"
}

// A Warning is a retention setting that lets a duplicate through, found
// when Run starts. A negative duration means "for ever".
type Warning struct {
	Kind            WarningKind
	Topic           string
	TopicRetention  time.Duration
	OffsetRetention time.Duration
	DedupRetention  time.Duration
	ReplayHorizon   time.Duration
	Err             error // ConfigNotChecked: why
}

// forever reports whether a Kafka retention of d means "never deleted".
func forever(d time.Duration) bool { return d < 0 }

// longer reports whether retention a outlives b (negative: for ever).
func longer(a, b time.Duration) bool {
	switch {
	case forever(a):
		return !forever(b)
	case forever(b):
		return false
	}
	return a > b
}

// checkRetention compares the settings read from the cluster with the
// dedup retention; offsetRetention is 0 when unknown.
func checkRetention(topic string, topicRetention, offsetRetention, dedupRetention, replay time.Duration) []Warning {
	var ws []Warning
	w := Warning{Topic: topic, TopicRetention: topicRetention, OffsetRetention: offsetRetention, DedupRetention: dedupRetention, ReplayHorizon: replay}
	if longer(topicRetention, dedupRetention) {
		w.Kind = TopicOutlivesDedup
		ws = append(ws, w)
		if offsetRetention != 0 && longer(topicRetention, offsetRetention) {
			w.Kind = OffsetsExpire
			ws = append(ws, w)
		}
	}
	return ws
}

// Warnings reads the topics' retention.ms and the brokers'
// offsets.retention.minutes and returns what Run warns about at start.
func (c *Consumer) Warnings(ctx context.Context) []Warning {
	ret := c.p.Retention()
	var ws []Warning
	if c.cfg.replay > 0 && c.cfg.replay > ret {
		ws = append(ws, Warning{Kind: ReplayOutlivesDedup, DedupRetention: ret, ReplayHorizon: c.cfg.replay})
	}
	adm := kadm.NewClient(c.cl)
	var offsetRet time.Duration
	if bcs, err := adm.DescribeBrokerConfigs(ctx); err == nil {
		for _, rc := range bcs {
			for _, cf := range rc.Configs {
				if cf.Key == "offsets.retention.minutes" && cf.Value != nil {
					if n, err := strconv.ParseInt(*cf.Value, 10, 64); err == nil {
						offsetRet = time.Duration(n) * time.Minute
					}
				}
			}
		}
	}
	tcs, err := adm.DescribeTopicConfigs(ctx, c.topics...)
	if err != nil {
		return append(ws, Warning{Kind: ConfigNotChecked, DedupRetention: ret, Err: err})
	}
	for _, t := range c.topics {
		rc, err := tcs.On(t, nil)
		if err == nil {
			err = rc.Err
		}
		if err != nil {
			ws = append(ws, Warning{Kind: ConfigNotChecked, Topic: t, DedupRetention: ret, Err: err})
			continue
		}
		// Kafka's default retention.ms is 7 days.
		topicRet := 7 * 24 * time.Hour
		for _, cf := range rc.Configs {
			if cf.Key == "retention.ms" && cf.Value != nil {
				if n, err := strconv.ParseInt(*cf.Value, 10, 64); err == nil {
					if n < 0 {
						topicRet = -1
					} else {
						topicRet = time.Duration(n) * time.Millisecond
					}
				}
			}
		}
		ws = append(ws, checkRetention(t, topicRet, offsetRet, ret, c.cfg.replay)...)
	}
	return ws
}

func (c *Consumer) warn(ctx context.Context) {
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for _, w := range c.Warnings(wctx) {
		c.cfg.logger.Warn("dedupkafka: "+w.Kind.String(), slog.String("topic", w.Topic),
			slog.Duration("topic_retention", w.TopicRetention), slog.Duration("offset_retention", w.OffsetRetention),
			slog.Duration("dedup_retention", w.DedupRetention), slog.Duration("replay_horizon", w.ReplayHorizon),
			slog.String("consumer", c.p.Name()), slog.Any("err", w.Err))
		if c.cfg.onWarning != nil {
			c.cfg.onWarning(ctx, w)
		}
	}
}
