package memstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
)

// A claim of a new key looked whether its record fits under the byte
// bound and added its bytes later, under its own shard's lock only: two
// claims in two shards that both looked before either added both fitted,
// and the store went over its bound, with strict capacity too (seen in
// about 1 round in 100 of 8 goroutines claiming past the bound). Here the
// room left is one record, and a claim in another shard looks while the
// first one is between its look and its record: exactly one may be
// admitted, and the bound holds.
func TestMaxBytesConcurrentShards(t *testing.T) {
	ctx := context.Background()
	id := func(i int) string { return fmt.Sprintf("key-%04d", i) } // one length: one record size
	size := int64(memstore.RecordOverhead + len("s") + len(id(0)))
	s, err := memstore.New(memstore.WithMaxBytes(2*size), memstore.WithStrictCapacity())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	claim := func(i int) (dedup.Claim, error) {
		return s.Claim(ctx, dedup.Key{Scope: "s", ID: id(i)}, "", time.Hour)
	}
	if c, err := claim(0); err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("first claim: %+v, %v", c, err)
	}
	// Two keys in two shards: the second one's look must not wait for
	// the first one's shard.
	b := 2
	for memstore.SameShard(s, id(1), id(b)) {
		b++
	}
	firstLooked, secondLooked, resume := make(chan struct{}), make(chan struct{}, 8), make(chan struct{})
	var looks atomic.Int32
	memstore.SetBytesLooked(s, func() {
		if looks.Add(1) == 1 {
			close(firstLooked)
			<-resume
			return
		}
		secondLooked <- struct{}{}
	})
	type res struct {
		c   dedup.Claim
		err error
	}
	first, second := make(chan res, 1), make(chan res, 1)
	go func() { c, err := claim(1); first <- res{c, err} }()
	<-firstLooked
	go func() { c, err := claim(b); second <- res{c, err} }()
	<-secondLooked
	close(resume)
	r1, r2 := <-first, <-second
	acquired := 0
	for _, r := range []res{r1, r2} {
		switch {
		case r.err == nil && r.c.Outcome == dedup.Acquired:
			acquired++
		case errors.Is(r.err, dedup.ErrFull):
		default:
			t.Errorf("claim: %+v, %v; want acquired or ErrFull", r.c, r.err)
		}
	}
	if st := s.Stats(); acquired != 1 || st.Bytes > 2*size {
		t.Fatalf("%d of the two claims acquired, %d records of %d bytes over a bound of %d; want one, within the bound", acquired, st.Records, st.Bytes, 2*size)
	}
}
