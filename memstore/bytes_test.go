package memstore_test

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

// TestMaxBytes: with a byte bound and strict capacity, new keys are
// refused with ErrFull once the records' bytes reach the bound, no live
// record is evicted, and expired or released records give their bytes back.
func TestMaxBytes(t *testing.T) {
	ctx := context.Background()
	result := make([]byte, 500)
	for _, strict := range []bool{true, false} {
		t.Run("strict="+strconv.FormatBool(strict), func(t *testing.T) {
			clock := storetest.NewClock()
			opts := []memstore.Option{memstore.WithClock(clock), memstore.WithShards(1), memstore.WithMaxBytes(20_000)}
			if strict {
				opts = append(opts, memstore.WithStrictCapacity())
			}
			s, err := memstore.New(opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			key := func(i int) dedup.Key { return dedup.Key{Scope: "b", ID: strconv.Itoa(i)} }
			full := 0
			for i := range 200 {
				c, err := s.Claim(ctx, key(i), "", time.Minute)
				if errors.Is(err, dedup.ErrFull) {
					full++
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				if err := s.Complete(ctx, c, result, time.Hour*time.Duration(1+i%3)); err != nil {
					t.Fatal(err)
				}
			}
			st := s.Stats()
			if st.Bytes > 20_000+int64(len(result)) {
				t.Fatalf("%d bytes held, bound 20,000 (plus one result)", st.Bytes)
			}
			if strict {
				if full == 0 || st.Evicted != 0 {
					t.Fatalf("strict: %d refused, %d evicted", full, st.Evicted)
				}
				if c, _ := s.Claim(ctx, key(0), "", time.Minute); c.Outcome != dedup.Duplicate {
					t.Fatalf("the first record was evicted: %v", c.Outcome)
				}
			} else if full != 0 || st.Evicted == 0 {
				t.Fatalf("evicting: %d refused, %d evicted", full, st.Evicted)
			}
			// Everything expires: new keys fit again.
			clock.Advance(4 * time.Hour)
			// A SHA-256 fingerprint is held inside the record; any other
			// is counted by its length plus 48 bytes.
			for _, fp := range []dedup.Fingerprint{dedup.FingerprintOf([]byte("x")), "fp"} {
				c, err := s.Claim(ctx, key(1000), fp, time.Minute)
				if err != nil || c.Outcome != dedup.Acquired {
					t.Fatalf("after expiry: %v %v", c.Outcome, err)
				}
				before := s.Stats().Bytes
				if err := s.Release(ctx, c); err != nil {
					t.Fatal(err)
				}
				want := memstore.RecordOverhead + int64(len("b")+len("1000"))
				if fp == "fp" {
					want += 48 + int64(len(fp))
				}
				if got := s.Stats().Bytes; before-got != want {
					t.Errorf("release of a claim with fingerprint %q gave back %d bytes, want %d", fp, before-got, want)
				}
			}
		})
	}
	if _, err := memstore.New(memstore.WithMaxBytes(-1)); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("negative bound: %v", err)
	}
}
