package dedupnats

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Headers of a dead-letter record, for reading records with the nats CLI.
const (
	headerDLConsumer = "Dedup-Consumer"
	headerDLKey      = "Dedup-Key"
)

// DLQ is a dead-letter stream: a [consumer.DeadLetterStore] on a
// JetStream stream. Each record is one message holding the JSON of a
// [consumer.DeadLetter], original payload and headers included, on
// subject "<prefix>.<consumer>"; its ID is its stream sequence. It is
// safe for concurrent use.
type DLQ struct {
	js     jetstream.JetStream
	stream jetstream.Stream
	name   string
	prefix string
}

var _ consumer.DeadLetterStore = (*DLQ)(nil)

// NewDLQ creates the dead-letter stream named stream (file storage,
// subjects "<prefix>.>", records kept until deleted, old records never
// discarded to make room), or opens it if it exists with those subjects.
// A bad option gives a [*dedup.ArgumentError]; a stream of that name with
// other subjects is an error too, rather than a stream whose records
// would go elsewhere.
func NewDLQ(ctx context.Context, js jetstream.JetStream, stream string, opts ...DLQOption) (*DLQ, error) {
	if js == nil {
		return nil, bad("jetstream", "is nil")
	}
	if stream == "" || strings.ContainsAny(stream, " .*>\t\r\n/\\") {
		return nil, bad("dead-letter stream", strconv.Quote(stream)+" is not a stream name")
	}
	cfg := defaultDLQConfig()
	for _, o := range opts {
		if o != nil {
			o.applyDLQ(&cfg)
		}
	}
	if cfg.prefix == "" {
		cfg.prefix = "dlq." + stream
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	subject := cfg.prefix + ".>"
	sc := jetstream.StreamConfig{
		Name:        stream,
		Description: "dead letters (dedupnats)",
		Subjects:    []string{subject},
		Retention:   jetstream.LimitsPolicy,
		Discard:     jetstream.DiscardNew,
		MaxAge:      cfg.maxAge,
		Duplicates:  cfg.duplicates,
		Storage:     cfg.storage,
		Replicas:    cfg.replicas,
	}
	s, err := js.CreateStream(ctx, sc)
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		s, err = js.Stream(ctx, stream)
		if err == nil && !slices.Contains(s.CachedInfo().Config.Subjects, subject) {
			return nil, fmt.Errorf("dedupnats: stream %s exists with subjects %v, not %s: pick another name or prefix", stream, s.CachedInfo().Config.Subjects, subject)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("dedupnats: dead-letter stream %s: %w", stream, err)
	}
	return &DLQ{js: js, stream: s, name: stream, prefix: cfg.prefix}, nil
}

// Stream returns the dead-letter stream's name.
func (q *DLQ) Stream() string { return q.name }

// Subject returns the subject of consumerName's dead letters.
func (q *DLQ) Subject(consumerName string) string { return q.prefix + "." + subjectToken(consumerName) }

// DeadLetter implements [consumer.DeadLetterSink]: it publishes dl and
// returns once the stream has stored it. The write is idempotent per
// (consumer, key, first failure) inside the stream's duplicate window
// (see [WithDLQDuplicateWindow]): a retry after a lost acknowledgement
// stores the record once.
func (q *DLQ) DeadLetter(ctx context.Context, dl consumer.DeadLetter) error {
	dl.ID = ""
	data, err := json.Marshal(dl)
	if err != nil {
		return fmt.Errorf("dedupnats: encode dead letter: %w", err)
	}
	h := nats.Header{}
	h.Set(jetstream.MsgIDHeader, recordID(&dl))
	h.Set(HeaderMsgID, headerValue(dl.Message.ID))
	h.Set(headerDLConsumer, headerValue(dl.Consumer))
	h.Set(headerDLKey, headerValue(dl.Key.String()))
	msg := &nats.Msg{Subject: q.Subject(dl.Consumer), Data: data, Header: h}
	if _, err := q.js.PublishMsg(ctx, msg, jetstream.WithExpectStream(q.name)); err != nil {
		return fmt.Errorf("dedupnats: write dead letter to %s: %w", q.name, err)
	}
	return nil
}

// List implements [consumer.DeadLetterStore]: up to limit records (all
// when limit <= 0) with sequences after the given ID, oldest first. A
// record that does not decode is returned with its ID, its raw bytes as
// the payload and a reason saying so, never skipped.
func (q *DLQ) List(ctx context.Context, after string, limit int) ([]consumer.DeadLetter, error) {
	seq := uint64(1)
	if after != "" {
		n, err := parseSeq(after)
		if err != nil {
			return nil, err
		}
		seq = n + 1
	}
	var out []consumer.DeadLetter
	for limit <= 0 || len(out) < limit {
		raw, err := q.stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(q.prefix+".>"))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			return out, fmt.Errorf("dedupnats: list dead letters in %s: %w", q.name, err)
		}
		out = append(out, decodeRecord(raw))
		seq = raw.Sequence + 1
	}
	return out, nil
}

// Get implements [consumer.DeadLetterStore]; a missing record gives an
// error matching [consumer.ErrNotFound].
func (q *DLQ) Get(ctx context.Context, id string) (consumer.DeadLetter, error) {
	seq, err := parseSeq(id)
	if err != nil {
		return consumer.DeadLetter{}, err
	}
	raw, err := q.stream.GetMsg(ctx, seq)
	if errors.Is(err, jetstream.ErrMsgNotFound) || err == nil && !strings.HasPrefix(raw.Subject, q.prefix+".") {
		return consumer.DeadLetter{}, fmt.Errorf("%w: %s in %s", consumer.ErrNotFound, id, q.name)
	}
	if err != nil {
		return consumer.DeadLetter{}, fmt.Errorf("dedupnats: get dead letter %s from %s: %w", id, q.name, err)
	}
	return decodeRecord(raw), nil
}

// Delete implements [consumer.DeadLetterStore]; deleting a missing record
// is not an error.
func (q *DLQ) Delete(ctx context.Context, id string) error {
	seq, err := parseSeq(id)
	if err != nil {
		return err
	}
	err = q.stream.DeleteMsg(ctx, seq)
	if err == nil {
		return nil
	}
	// The server says "no message found" in the text of a failed delete;
	// tell a missing record from a failure by looking.
	if _, gerr := q.stream.GetMsg(ctx, seq); errors.Is(gerr, jetstream.ErrMsgNotFound) {
		return nil
	}
	return fmt.Errorf("dedupnats: delete dead letter %s from %s: %w", id, q.name, err)
}

// Count returns the number of records in the stream.
func (q *DLQ) Count(ctx context.Context) (uint64, error) {
	info, err := q.stream.Info(ctx)
	if err != nil {
		return 0, fmt.Errorf("dedupnats: dead-letter stream %s: %w", q.name, err)
	}
	return info.State.Msgs, nil
}

func decodeRecord(raw *jetstream.RawStreamMsg) consumer.DeadLetter {
	var dl consumer.DeadLetter
	if err := json.Unmarshal(raw.Data, &dl); err != nil {
		dl = consumer.DeadLetter{
			Reason:  "dedupnats: record does not decode as a dead letter: " + err.Error(),
			Message: consumer.Message{Subject: raw.Subject, Payload: raw.Data},
		}
	}
	dl.ID = strconv.FormatUint(raw.Sequence, 10)
	return dl
}

// recordID is the Nats-Msg-Id of a dead-letter write: a digest of the
// consumer, the key and the first failure (and the message ID, for a
// message dead-lettered without a key).
func recordID(dl *consumer.DeadLetter) string {
	h := sha256.New()
	for _, s := range []string{dl.Consumer, dl.Key.Scope, dl.Key.ID, dl.Message.ID,
		strconv.FormatInt(dl.FirstFailure.UnixNano(), 10)} {
		h.Write([]byte(strconv.Itoa(len(s))))
		h.Write([]byte{':'})
		h.Write([]byte(s))
	}
	return "dl-" + hex.EncodeToString(h.Sum(nil)[:16])
}

func parseSeq(id string) (uint64, error) {
	n, err := strconv.ParseUint(id, 10, 64)
	if err != nil || n == 0 {
		return 0, &dedup.ArgumentError{Arg: "dead letter id", Reason: strconv.Quote(id) + " is not a stream sequence"}
	}
	return n, nil
}

// subjectToken turns a consumer name into one subject token.
func subjectToken(s string) string {
	if s == "" {
		return "_"
	}
	b := []byte(s)
	for i, c := range b {
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '-', c == '_':
		default:
			b[i] = '_'
		}
	}
	return string(b)
}

// headerValue makes s safe as a header value.
func headerValue(s string) string {
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
}
