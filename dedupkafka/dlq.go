package dedupkafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Headers of a dead-letter record, beside the original record's own.
const (
	HeaderDLConsumer     = "Dedup-DL-Consumer"
	HeaderDLKeyScope     = "Dedup-DL-Key-Scope"
	HeaderDLKeyID        = "Dedup-DL-Key-Id"
	HeaderDLClass        = "Dedup-DL-Class"
	HeaderDLReason       = "Dedup-DL-Reason"
	HeaderDLAttempts     = "Dedup-DL-Attempts"
	HeaderDLFirstFailure = "Dedup-DL-First-Failure"
	HeaderDLLastFailure  = "Dedup-DL-Last-Failure"
	HeaderDLTopic        = "Dedup-DL-Topic"
	HeaderDLSource       = "Dedup-DL-Source"
	// HeaderDLDeleted marks a tombstone: a record that deletes the record
	// whose ID it carries (Kafka cannot delete one record).
	HeaderDLDeleted = "Dedup-DL-Deleted"
)

// DLQ is a dead-letter topic: a [consumer.DeadLetterStore] on Kafka. A
// record is the original one, value, key and headers unchanged, with the
// message ID in Dedup-Msg-Id (also when the consumer derived it from the
// source offset), plus the Dedup-DL-* headers with the failure (consumer,
// key, class, reason, attempts, failure times, source topic and offset).
// A record's ID is "<partition>-<offset>" in the dead-letter topic, zero
// padded so that IDs sort in write order within a partition.
//
// Kafka cannot delete one record: Delete appends a tombstone (a record
// with HeaderDLDeleted), and List and Get skip what a tombstone deleted.
// List reads the topic from its start to its end offsets, which suits a
// dead-letter topic (few records), not a backlog of millions. It is safe
// for concurrent use.
type DLQ struct {
	topic   string
	brokers []string
	kopts   []kgo.Opt
	pub     *Publisher
	adm     *kadm.Client
}

var _ consumer.DeadLetterStore = (*DLQ)(nil)

// NewDLQ returns the store over topic, creating the topic (one partition,
// the cluster's default replication) when it does not exist. opts are
// franz-go options for its clients (TLS, SASL). A bad argument gives a
// [*dedup.ArgumentError] before any I/O.
func NewDLQ(ctx context.Context, brokers []string, topic string, opts ...kgo.Opt) (*DLQ, error) {
	if !validTopic(topic) {
		return nil, bad("dead-letter topic", strconv.Quote(topic)+" is not a topic name")
	}
	pub, err := NewPublisher(brokers, WithProducerOptions(opts...))
	if err != nil {
		return nil, err
	}
	q := &DLQ{topic: topic, brokers: slices.Clone(brokers), kopts: slices.Clone(opts), pub: pub, adm: kadm.NewClient(pub.cl)}
	if _, err := q.adm.CreateTopic(ctx, 1, -1, nil, topic); err != nil && !errors.Is(err, kerr.TopicAlreadyExists) {
		pub.Close()
		return nil, fmt.Errorf("dedupkafka: create dead-letter topic %s: %w", topic, err)
	}
	return q, nil
}

// OpenDLQ returns the store over an existing topic (for reading and
// replaying, as `dedup dlq` does): a missing topic is an error, never
// created.
func OpenDLQ(ctx context.Context, brokers []string, topic string, opts ...kgo.Opt) (*DLQ, error) {
	if !validTopic(topic) {
		return nil, bad("dead-letter topic", strconv.Quote(topic)+" is not a topic name")
	}
	pub, err := NewPublisher(brokers, WithProducerOptions(opts...))
	if err != nil {
		return nil, err
	}
	q := &DLQ{topic: topic, brokers: slices.Clone(brokers), kopts: slices.Clone(opts), pub: pub, adm: kadm.NewClient(pub.cl)}
	tds, err := q.adm.ListTopics(ctx, topic)
	if err == nil {
		err = tds.Error()
	}
	if err == nil && !tds.Has(topic) {
		err = kerr.UnknownTopicOrPartition
	}
	if err != nil {
		pub.Close()
		return nil, fmt.Errorf("dedupkafka: open dead-letter topic %s: %w", topic, err)
	}
	return q, nil
}

// Topic returns the dead-letter topic.
func (q *DLQ) Topic() string { return q.topic }

// Close closes the store's client.
func (q *DLQ) Close() error { return q.pub.Close() }

func dlID(partition int32, offset int64) string {
	return fmt.Sprintf("%04d-%019d", partition, offset)
}

// DeadLetter implements [consumer.DeadLetterSink]: it produces the record
// and returns once the broker acknowledged it (acks=all).
func (q *DLQ) DeadLetter(ctx context.Context, dl consumer.DeadLetter) error {
	m := &dl.Message
	r := recordOf(m)
	r.Topic = q.topic
	add := func(k, v string) { r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)}) }
	add(HeaderDLConsumer, dl.Consumer)
	add(HeaderDLKeyScope, dl.Key.Scope)
	add(HeaderDLKeyID, dl.Key.ID)
	add(HeaderDLClass, dl.Class.String())
	add(HeaderDLReason, dl.Reason)
	add(HeaderDLAttempts, strconv.Itoa(dl.Attempts))
	add(HeaderDLFirstFailure, dl.FirstFailure.UTC().Format(time.RFC3339Nano))
	add(HeaderDLLastFailure, dl.LastFailure.UTC().Format(time.RFC3339Nano))
	add(HeaderDLTopic, m.Subject)
	if src := m.Headers[HeaderKafkaSource]; src != "" {
		add(HeaderDLSource, src)
	}
	if err := q.pub.cl.ProduceSync(ctx, r).FirstErr(); err != nil {
		return fmt.Errorf("dedupkafka: write dead letter to %s: %w", q.topic, err)
	}
	return nil
}

// record decodes a record of the dead-letter topic.
func record(r *kgo.Record) (dl consumer.DeadLetter, deletes string) {
	h := map[string]string{}
	for _, x := range r.Headers {
		if _, ok := h[x.Key]; !ok {
			h[x.Key] = string(x.Value)
		}
	}
	if d := h[HeaderDLDeleted]; d != "" {
		return dl, d
	}
	dl.ID = dlID(r.Partition, r.Offset)
	dl.Consumer = h[HeaderDLConsumer]
	dl.Key = dedup.Key{Scope: h[HeaderDLKeyScope], ID: h[HeaderDLKeyID]}
	dl.Class = parseClass(h[HeaderDLClass])
	dl.Reason = h[HeaderDLReason]
	dl.Attempts, _ = strconv.Atoi(h[HeaderDLAttempts])
	dl.FirstFailure, _ = time.Parse(time.RFC3339Nano, h[HeaderDLFirstFailure])
	dl.LastFailure, _ = time.Parse(time.RFC3339Nano, h[HeaderDLLastFailure])
	m := consumer.Message{ID: h[HeaderMsgID], Subject: h[HeaderDLTopic], Payload: r.Value, Published: r.Timestamp,
		BusinessKey: h[HeaderBusinessKey], Aggregate: h[HeaderAggregate], Headers: map[string]string{}}
	if v, err := strconv.ParseUint(h[HeaderVersion], 10, 64); err == nil {
		m.Version = v
	}
	for k, v := range h {
		if !strings.HasPrefix(k, "Dedup-DL-") {
			m.Headers[k] = v
		}
	}
	if src := h[HeaderDLSource]; src != "" {
		m.Headers[HeaderKafkaSource] = src
	}
	if r.Key != nil {
		m.Headers[HeaderKafkaKey] = string(r.Key)
	}
	dl.Message = m
	return dl, ""
}

func parseClass(s string) consumer.Class {
	for c := consumer.Unclassified; c <= consumer.ClassUnknown; c++ {
		if c.String() == s {
			return c
		}
	}
	return consumer.Unclassified
}

// all reads the topic from its start to its end offsets and returns the
// records not deleted, in ID order.
func (q *DLQ) all(ctx context.Context) ([]consumer.DeadLetter, error) {
	starts, err := q.adm.ListStartOffsets(ctx, q.topic)
	if err == nil {
		err = starts.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("dedupkafka: read dead-letter topic %s: %w", q.topic, err)
	}
	ends, err := q.adm.ListEndOffsets(ctx, q.topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return nil, fmt.Errorf("dedupkafka: read dead-letter topic %s: %w", q.topic, err)
	}
	want := map[int32]int64{} // partition -> end offset still to reach
	from := map[int32]kgo.Offset{}
	ends.Each(func(o kadm.ListedOffset) {
		s, _ := starts.Lookup(o.Topic, o.Partition)
		if o.Offset > s.Offset {
			want[o.Partition] = o.Offset
			from[o.Partition] = kgo.NewOffset().At(s.Offset)
		}
	})
	if len(want) == 0 {
		return nil, nil
	}
	cl, err := kgo.NewClient(append(slices.Clone(q.kopts), kgo.SeedBrokers(q.brokers...),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{q.topic: from}))...)
	if err != nil {
		return nil, fmt.Errorf("dedupkafka: read dead-letter topic %s: %w", q.topic, err)
	}
	defer cl.Close()
	var out []consumer.DeadLetter
	deleted := map[string]bool{}
	for len(want) > 0 {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		var ferr error
		fs.EachError(func(_ string, _ int32, err error) { ferr = err })
		if ferr != nil {
			return nil, fmt.Errorf("dedupkafka: read dead-letter topic %s: %w", q.topic, ferr)
		}
		fs.EachRecord(func(r *kgo.Record) {
			if end, ok := want[r.Partition]; ok {
				if r.Offset+1 >= end {
					delete(want, r.Partition)
				}
				if r.Offset >= end {
					return
				}
			} else {
				return
			}
			dl, del := record(r)
			if del != "" {
				deleted[del] = true
				return
			}
			out = append(out, dl)
		})
	}
	out = slices.DeleteFunc(out, func(d consumer.DeadLetter) bool { return deleted[d.ID] })
	slices.SortFunc(out, func(a, b consumer.DeadLetter) int { return strings.Compare(a.ID, b.ID) })
	return out, nil
}

// List implements [consumer.DeadLetterStore]: up to limit records (all
// when limit <= 0) with IDs after the given one, in ID order.
func (q *DLQ) List(ctx context.Context, after string, limit int) ([]consumer.DeadLetter, error) {
	all, err := q.all(ctx)
	if err != nil {
		return nil, err
	}
	i, _ := slices.BinarySearchFunc(all, after, func(d consumer.DeadLetter, id string) int {
		if d.ID <= id {
			return -1
		}
		return 1
	})
	all = all[i:]
	if limit > 0 && len(all) > limit {
		all = all[:limit]
	}
	return all, nil
}

// Get implements [consumer.DeadLetterStore].
func (q *DLQ) Get(ctx context.Context, id string) (consumer.DeadLetter, error) {
	all, err := q.all(ctx)
	if err != nil {
		return consumer.DeadLetter{}, err
	}
	for _, d := range all {
		if d.ID == id {
			return d, nil
		}
	}
	return consumer.DeadLetter{}, consumer.ErrNotFound
}

// Delete implements [consumer.DeadLetterStore]: it appends a tombstone for
// id. Deleting a missing record is not an error.
func (q *DLQ) Delete(ctx context.Context, id string) error {
	if id == "" {
		return bad("dead letter id", "is empty")
	}
	r := &kgo.Record{Topic: q.topic, Headers: []kgo.RecordHeader{{Key: HeaderDLDeleted, Value: []byte(id)}}}
	if err := q.pub.cl.ProduceSync(ctx, r).FirstErr(); err != nil {
		return fmt.Errorf("dedupkafka: delete dead letter %s: %w", id, err)
	}
	return nil
}
