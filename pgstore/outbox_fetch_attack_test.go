package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
)

// A read whose limit is far above the rows there are (a direct caller's
// "everything", up to the largest limit the statement takes) returns
// them: the read does not size its result by the limit alone.
func TestOutboxFetchLimitFarAboveTheRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := openStore(t)
	src, err := s.OutboxSource(pgstore.WithOutboxPartitions(4))
	if err != nil {
		t.Fatal(err)
	}
	k := keysOf(t, s, 1, 1)[0]
	writeOutboxTx(t, s, nil, outbox.Message{ID: "a", Topic: "t", Key: k, Payload: []byte("1")},
		outbox.Message{ID: "b", Topic: "t", Key: k, Payload: []byte("2")})
	l, ok, err := src.Acquire(ctx, "r1", 1, time.Hour)
	if err != nil || !ok {
		t.Fatalf("Acquire = %v, %v", ok, err)
	}
	got, err := src.Fetch(ctx, l, math.MaxInt32, false)
	if err != nil || len(got) != 2 || got[0].ID != "a" || got[1].ID != "b" {
		t.Fatalf("Fetch = %v, %v", got, err)
	}
	next, err := src.FetchNext(ctx, l, got[:1], math.MaxInt32-1, false)
	if err != nil || len(next) != 1 || next[0].ID != "b" {
		t.Fatalf("FetchNext = %v, %v", next, err)
	}
}

// The reads' copies of the rows' fields, in every pgx query mode, on the
// plain and the time-partitioned outbox under a table prefix: payloads at
// and around the read's chunk sides (a huge first row, a row filling a
// chunk exactly, empty rows between), headers with escapes, unicode, HTML
// characters and many keys (the writer's JSON as jsonb normalizes it) and
// the JSON null; Fetch, FetchNext and every shorter Fetch agree with what
// was written; nothing a read returned changes when the caller writes
// into or grows another message's payload, or when later reads run and
// their results are overwritten.
func TestOutboxFetchEdgeRowsKeepTheirBytes(t *testing.T) {
	eachLayoutAndMode(t, func(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource) {
		ctx := context.Background()
		if err := src.CreateIndex(ctx); err != nil {
			t.Fatal(err)
		}
		ks := keysOf(t, s, 3, 2)
		sizes := []int{100<<10 + 1, 4096, 0, 61440, 1, 0, 65536, 65537, 4095, 1, 0, 3}
		hdrs := []map[string]string{
			{"q": `a"b\c/d` + "\t\x01\x7f", "html": "<a href='x'>&amp;</a>"},
			{"u": "é ü 日本 🙂 \u2028\u2029", "e": "", "{}": "{}"},
			{"n": "1", "b": "true", "z": "null", "nested": `{"a":[1,2]}`},
		}
		many := map[string]string{}
		for i := range 40 {
			many[fmt.Sprintf("k%02d", 39-i)] = strings.Repeat("v", i)
		}
		hdrs = append(hdrs, many)
		var want []outbox.Message
		for i, n := range sizes {
			p := make([]byte, n)
			for j := range p {
				p[j] = byte(i*31 + j*7)
			}
			m := outbox.Message{ID: fmt.Sprintf("id-%d-é", i), Topic: []string{"t1", "t1", "t2"}[i%3], Key: ks[i%2], Payload: p}
			if i%4 != 3 {
				m.Headers = hdrs[i%len(hdrs)]
			}
			want = append(want, m)
		}
		writeOutboxTx(t, s, nil, want...)
		// A row whose headers are the JSON null: no headers.
		writeOutboxTx(t, s, nil, outbox.Message{ID: "null-headers", Topic: "t1", Key: ks[0], Payload: []byte("n")})
		if tag, err := s.Pool().Exec(ctx, `UPDATE `+s.Tables().Outbox+` SET headers = 'null'::jsonb WHERE message_key = 'null-headers'`); err != nil || tag.RowsAffected() != 1 {
			t.Fatal(tag, err)
		}
		want = append(want, outbox.Message{ID: "null-headers", Topic: "t1", Key: ks[0], Payload: []byte("n")})
		l, ok, err := src.Acquire(ctx, "r1", 3, time.Hour)
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
					!maps.Equal(g.Headers, w.Headers) || (i > 0 && g.Seq <= got[i-1].Seq) {
					t.Fatalf("%s: message %d = %q %q %q payload %d bytes headers %q; want %q %q %q payload %d bytes headers %q",
						what, i, g.ID, g.Topic, g.Key, len(g.Payload), g.Headers, w.ID, w.Topic, w.Key, len(w.Payload), w.Headers)
				}
			}
		}
		all, err := src.Fetch(ctx, l, 100, false)
		if err != nil {
			t.Fatal(err)
		}
		same("Fetch", all, want)
		for i := 1; i < len(want); i++ {
			ahead, err := src.FetchNext(ctx, l, all[:i], 100, false)
			if err != nil {
				t.Fatal(err)
			}
			same(fmt.Sprintf("FetchNext after %d", i), ahead, want[i:])
			part, err := src.Fetch(ctx, l, i, false)
			if err != nil {
				t.Fatal(err)
			}
			same(fmt.Sprintf("Fetch of %d", i), part, want[:i])
			// The caller owns what it got: overwrite and grow it all.
			for _, r := range [][]outbox.Message{ahead, part} {
				for j := range r {
					for b := range r[j].Payload {
						r[j].Payload[b] = 0xff
					}
					_ = append(r[j].Payload, 0xee, 0xee)
					r[j].Payload = append(r[j].Payload, 0xdd)
				}
			}
		}
		same("Fetch, after later reads were overwritten", all, want)
		// Overwriting one message's payload leaves every other intact.
		for i := range all {
			before := bytes.Clone(want[i].Payload)
			for b := range all[i].Payload {
				all[i].Payload[b] ^= 0x5a
			}
			_ = append(all[i].Payload, 1, 2, 3)
			for j := range all {
				if j != i && !bytes.Equal(all[j].Payload, want[j].Payload) {
					t.Fatalf("writing message %d's payload changed message %d's", i, j)
				}
			}
			for b := range all[i].Payload {
				all[i].Payload[b] ^= 0x5a
			}
			if !bytes.Equal(all[i].Payload, before) {
				t.Fatalf("message %d's payload", i)
			}
		}
	})
}

// The plain read (Fetch) and the read under a batch in flight
// (FetchNext) are two statements: they agree on which rows come and in
// what order, in every pgx query mode and layout: published rows never,
// a quarantined row never and its key's later rows only with
// skipBlocked, a row waiting for its retry time never and its key's
// later rows neither; at every limit, Fetch returns the first rows of
// the full read and FetchNext with the first row in flight the rows after
// it (a row passed over counts against the statement's LIMIT: either read
// may come short).
func TestOutboxFetchAndFetchNextAgree(t *testing.T) {
	eachLayoutAndMode(t, func(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource) {
		ctx := context.Background()
		ks := keysOf(t, s, 2, 4)
		other := keysOf(t, s, 0, 1)[0]
		var msgs []outbox.Message
		for i := range 16 {
			msgs = append(msgs, outbox.Message{ID: fmt.Sprintf("m%02d", i), Topic: "t", Key: ks[i%4], Payload: []byte{byte(i)}},
				outbox.Message{ID: fmt.Sprintf("o%02d", i), Topic: "t", Key: other})
		}
		writeOutboxTx(t, s, nil, msgs...)
		l, ok, err := src.Acquire(ctx, "r1", 2, time.Hour)
		if err != nil || !ok {
			t.Fatalf("Acquire = %v, %v", ok, err)
		}
		all, err := src.Fetch(ctx, l, 100, false)
		if err != nil || len(all) != 16 {
			t.Fatalf("Fetch = %d messages, %v", len(all), err)
		}
		// m05 (key 1) quarantined, m06 (key 2) waits an hour, m03
		// and m07 (key 3) published.
		if err := src.Fail(ctx, l, []outbox.Failure{{Seq: all[5].Seq, Err: "poison", Quarantine: true}, {Seq: all[6].Seq, Err: "later", RetryAfter: time.Hour}}); err != nil {
			t.Fatal(err)
		}
		if err := src.Mark(ctx, l, []int64{all[3].Seq, all[7].Seq}); err != nil {
			t.Fatal(err)
		}
		ids := func(ms []outbox.Message) string {
			var b strings.Builder
			for _, m := range ms {
				b.WriteString(m.ID + " ")
			}
			return b.String()
		}
		wants := map[bool]string{
			false: "m00 m01 m02 m04 m08 m11 m12 m15 ",
			true:  "m00 m01 m02 m04 m08 m09 m11 m12 m13 m15 ",
		}
		for _, skip := range []bool{false, true} {
			full, err := src.Fetch(ctx, l, 100, skip)
			if err != nil {
				t.Fatal(err)
			}
			if got := ids(full); got != wants[skip] {
				t.Fatalf("skipBlocked %v: Fetch = %s, want %s", skip, got, wants[skip])
			}
			for limit := 1; limit <= len(full)+1; limit++ {
				f, err := src.Fetch(ctx, l, limit, skip)
				if err != nil {
					t.Fatal(err)
				}
				if got, want := ids(f), ids(full[:min(limit, len(full))]); !strings.HasPrefix(want, got) || len(f) == 0 {
					t.Fatalf("skipBlocked %v: Fetch of %d = %s, want %s", skip, limit, got, want)
				}
				n, err := src.FetchNext(ctx, l, full[:1], limit, skip)
				if err != nil {
					t.Fatal(err)
				}
				if got, want := ids(n), ids(full[1:min(limit+1, len(full))]); !strings.HasPrefix(want, got) || len(n) == 0 {
					t.Fatalf("skipBlocked %v: FetchNext of %d = %s, want %s", skip, limit, got, want)
				}
			}
		}
	})
}

// eachLayoutAndMode runs f in parallel subtests on a store of its own
// with the table prefix "rv_" and a source of 4 partitions, for the plain
// and the time-partitioned outbox in each pgx query mode.
func eachLayoutAndMode(t *testing.T, f func(t *testing.T, s *pgstore.Store, src *pgstore.OutboxSource)) {
	t.Parallel()
	for _, timeParts := range []bool{false, true} {
		for _, qm := range queryModes {
			t.Run(fmt.Sprintf("timeparts=%v/%v", timeParts, qm), func(t *testing.T) {
				t.Parallel()
				pool := newPool(t, 2, inMode(qm))
				s := openStoreOn(t, pool, freshSchema(t, testPool(t)), pgstore.WithTablePrefix("rv_"))
				if timeParts {
					if err := s.PartitionOutbox(context.Background(), time.Hour); err != nil {
						t.Fatal(err)
					}
				}
				src, err := s.OutboxSource(pgstore.WithOutboxPartitions(4))
				if err != nil {
					t.Fatal(err)
				}
				f(t, s, src)
			})
		}
	}
}
