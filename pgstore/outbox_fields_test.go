package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
)

// The relay's reads return every message as written, in every pgx query
// mode: IDs, keys and topics (two topics interleaved), payloads (empty,
// small, and larger than the read's payload chunks, next to each other),
// headers (none and several), with the plain read (Fetch) and the read
// under a batch in flight (FetchNext); and a message's payload cannot be
// grown into its neighbour's (the read copies the payloads into shared
// chunks).
func TestOutboxFetchReturnsMessagesAsWritten(t *testing.T) {
	t.Parallel()
	for _, qm := range queryModes {
		t.Run(qm.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := newPool(t, 2, inMode(qm))
			s := openStoreOn(t, pool, freshSchema(t, testPool(t)))
			src, err := s.OutboxSource(pgstore.WithOutboxPartitions(4))
			if err != nil {
				t.Fatal(err)
			}
			ks := keysOf(t, s, 2, 3)
			var want []outbox.Message
			for i := range 9 {
				m := outbox.Message{ID: fmt.Sprintf("id-%d-%s", i, bytes.Repeat([]byte{'i'}, i)), Topic: []string{"orders", "payments"}[i%3/2],
					Key: ks[i%3], Payload: bytes.Repeat([]byte{byte('a' + i)}, []int{0, 1, 200, 70 << 10, 3, 0, 5000, 100 << 10, 7}[i])}
				if i%2 == 1 {
					m.Headers = map[string]string{"traceparent": fmt.Sprint("00-", i), "x": "{}"}
				}
				want = append(want, m)
			}
			writeOutboxTx(t, s, nil, want...)
			l, ok, err := src.Acquire(ctx, "r1", 2, time.Hour)
			if err != nil || !ok {
				t.Fatalf("Acquire = %v, %v", ok, err)
			}
			same := func(what string, got, want []outbox.Message) {
				t.Helper()
				if len(got) != len(want) {
					t.Fatalf("%s: %d messages, want %d", what, len(got), len(want))
				}
				for i, g := range got {
					w := want[i]
					if g.ID != w.ID || g.Topic != w.Topic || g.Key != w.Key || !bytes.Equal(g.Payload, w.Payload) || g.Payload == nil ||
						!maps.Equal(g.Headers, w.Headers) || g.Attempts != 0 || g.CreatedAt.IsZero() || (i > 0 && g.Seq <= got[i-1].Seq) {
						t.Fatalf("%s: message %d = %q %q %q payload %d bytes (nil %v) headers %v attempts %d created %v seq %d; want %q %q %q payload %d bytes headers %v",
							what, i, g.ID, g.Topic, g.Key, len(g.Payload), g.Payload == nil, g.Headers, g.Attempts, g.CreatedAt, g.Seq,
							w.ID, w.Topic, w.Key, len(w.Payload), w.Headers)
					}
				}
			}
			all, err := src.Fetch(ctx, l, 100, false)
			if err != nil {
				t.Fatal(err)
			}
			same("Fetch", all, want)
			ahead, err := src.FetchNext(ctx, l, all[:4], 100, false)
			if err != nil {
				t.Fatal(err)
			}
			same("FetchNext", ahead, want[4:])
			part, err := src.Fetch(ctx, l, 3, false)
			if err != nil {
				t.Fatal(err)
			}
			same("Fetch of 3", part, want[:3])
			for _, m := range all {
				_ = append(m.Payload, '!') // grows in place only within its own capacity
			}
			same("Fetch, after growing each payload", all, want)
		})
	}
}
