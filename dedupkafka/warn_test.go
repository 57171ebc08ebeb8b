package dedupkafka

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

func TestCheckRetention(t *testing.T) {
	day := 24 * time.Hour
	for _, tc := range []struct {
		topic, offsets, dedup time.Duration
		want                  []WarningKind
	}{
		{7 * day, 7 * day, 7 * day, nil},
		{time.Hour, 0, 24 * time.Hour, nil},
		{7 * day, 0, day, []WarningKind{TopicOutlivesDedup}},
		{7 * day, 7 * day, day, []WarningKind{TopicOutlivesDedup}},
		{-1, 7 * day, day, []WarningKind{TopicOutlivesDedup, OffsetsExpire}},
		{30 * day, 7 * day, day, []WarningKind{TopicOutlivesDedup, OffsetsExpire}},
		{-1, 0, time.Duration(1<<63 - 1), []WarningKind{TopicOutlivesDedup}},
	} {
		ws := checkRetention("t", tc.topic, tc.offsets, tc.dedup, 0)
		var got []WarningKind
		for _, w := range ws {
			got = append(got, w.Kind)
		}
		if len(got) != len(tc.want) || (len(got) > 0 && got[0] != tc.want[0]) || (len(got) > 1 && got[1] != tc.want[1]) {
			t.Errorf("topic %v offsets %v dedup %v: %v, want %v", tc.topic, tc.offsets, tc.dedup, got, tc.want)
		}
	}
}

// Run's warnings read retention.ms from the cluster.
func TestWarningsFromCluster(t *testing.T) {
	_, seeds := cluster(t, 1, "short")
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	forever, hour := "-1", "3600000"
	adm := kadm.NewClient(cl)
	if _, err := adm.CreateTopic(context.Background(), 1, 1, map[string]*string{"retention.ms": &forever}, "forever"); err != nil {
		t.Fatal(err)
	}
	if _, err := adm.AlterTopicConfigs(context.Background(), []kadm.AlterConfig{{Name: "retention.ms", Value: &hour}}, "short"); err != nil {
		t.Fatal(err)
	}
	p := processor(t, nil, newEffects(), nil, consumer.WithRetention(24*time.Hour))
	var seen []Warning
	c, err := NewConsumer(seeds, "g", []string{"short", "forever"}, p, WithLogger(quiet), WithReplayHorizon(48*time.Hour),
		WithWarning(func(_ context.Context, w Warning) { seen = append(seen, w) }))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.warn(context.Background())
	kinds := map[WarningKind]string{}
	for _, w := range seen {
		kinds[w.Kind] = w.Topic
	}
	if kinds[TopicOutlivesDedup] != "forever" || kinds[ReplayOutlivesDedup] != "" || len(seen) < 2 {
		t.Fatalf("warnings %+v", seen)
	}
	for _, w := range seen {
		if w.Topic == "short" {
			t.Errorf("a topic kept 1h warned against a 24h dedup retention: %+v", w)
		}
	}
	if _, ok := kinds[ReplayOutlivesDedup]; !ok {
		t.Errorf("no warning for a 48h replay horizon over a 24h retention: %+v", seen)
	}
}
