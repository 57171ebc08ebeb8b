package memstore

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/storetest"
)

// The byte bound is the store's, while room is made shard by shard: when
// the bytes sit in other shards, a new key's claim frees them there. A
// non-strict store evicts the soonest-expiring completed record elsewhere
// (it refused the key with ErrFull before); a strict one frees expired
// records elsewhere and refuses only while every record is live.
func TestByteBoundFreesOtherShards(t *testing.T) {
	for _, strict := range []bool{false, true} {
		t.Run("strict="+strconv.FormatBool(strict), func(t *testing.T) {
			ctx := context.Background()
			clock := storetest.NewClock()
			opts := []Option{WithClock(clock), WithShards(2), WithMaxBytes(2800)}
			if strict {
				opts = append(opts, WithStrictCapacity())
			}
			s, err := New(opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			first := &s.shards[0]
			// IDs of each shard.
			var in0, in1 []string
			for i := 0; len(in0) < 100 || len(in1) < 1; i++ {
				id := "k" + strconv.Itoa(i)
				if _, sh := s.hash(id); sh == first {
					in0 = append(in0, id)
				} else {
					in1 = append(in1, id)
				}
			}
			// Fill the bound with completed records of shard 0.
			n := 0
			for _, id := range in0 {
				k := dedup.Key{Scope: "s", ID: id}
				if s.bytes.Load()+recordSize(k, &print{}) > s.maxBytes {
					break
				}
				c, err := s.Claim(ctx, k, "", time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				if err := s.Complete(ctx, c, nil, time.Hour); err != nil {
					t.Fatal(err)
				}
				n++
			}
			if n < 5 || n == len(in0) || s.Stats().Evicted != 0 {
				t.Fatalf("%d records in shard 0 before the bound, want the bound reached after a few", n)
			}
			key := dedup.Key{Scope: "s", ID: in1[0]}
			c, err := s.Claim(ctx, key, "", time.Minute)
			if strict {
				// Every record is live: refused, nothing evicted.
				if !errors.Is(err, dedup.ErrFull) || s.Stats().Evicted != 0 {
					t.Fatalf("strict, all live: %v, evicted %d; want ErrFull and none", err, s.Stats().Evicted)
				}
				// Once they expire, shard 0 frees them for shard 1's key.
				clock.Advance(2 * time.Hour)
				c, err = s.Claim(ctx, key, "", time.Minute)
			}
			if err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("claim in shard 1 with the bytes in shard 0: %v, %v", c.Outcome, err)
			}
			if st := s.Stats(); st.Bytes > 2800 {
				t.Fatalf("%+v: over the byte bound", st)
			}
			if ev := s.Stats().Evicted; strict && ev != 0 || !strict && ev == 0 {
				t.Fatalf("strict %v: evicted %d", strict, ev)
			}
		})
	}
}
