package redisstore_test

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/redis/go-redis/v9"
	"github.com/redis/rueidis"
)

// Run: go test -run XXX -bench . -benchtime 3s ./redisstore/
// GOMAXPROCS is 2 here, so SetParallelism(32) is 64 goroutines and
// SetParallelism(128) is 256.

var run = strconv.FormatInt(time.Now().UnixNano(), 36)

func perSecond(b *testing.B) {
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "ops/s")
}

// parallel runs op b.N times from g goroutines: a plain loop for 1,
// b.RunParallel with the matching parallelism otherwise.
// The keys come from one counter for the whole run, because the testing
// package calls a benchmark function several times with growing b.N.
var next atomic.Int64

func parallel(b *testing.B, g int, op func(ctx context.Context, i int64) error) {
	ctx := context.Background()
	if g == 1 {
		for b.Loop() {
			if err := op(ctx, next.Add(1)); err != nil {
				b.Fatal(err)
			}
		}
		perSecond(b)
		return
	}
	b.SetParallelism(max(g/runtime.GOMAXPROCS(0), 1))
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if err := op(ctx, next.Add(1)); err != nil {
				b.Error(err)
				return
			}
		}
	})
	perSecond(b)
}

// BenchmarkNaiveSetNX is what most write-ups do: go-redis SetNX from one
// goroutine, one round trip per message, no lease lifecycle.
func BenchmarkNaiveSetNX(b *testing.B) {
	addrs := standaloneAddrs(b)
	c := redis.NewClient(&redis.Options{Addr: addrs[0]})
	defer c.Close()
	ctx := context.Background()
	i := 0
	for b.Loop() {
		if _, err := c.SetNX(ctx, "bench:naive:"+run+":"+strconv.Itoa(i), "1", time.Minute).Result(); err != nil {
			b.Fatal(err)
		}
		i++
	}
	perSecond(b)
}

// BenchmarkRawSetNXEX is the chosen client's ceiling: rueidis SET NX EX
// auto-pipelined from many goroutines, with no lifecycle at all.
func BenchmarkRawSetNXEX(b *testing.B) {
	addrs := standaloneAddrs(b)
	c, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: addrs, DisableCache: true})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	for _, g := range []int{64, 256} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			prefix := "bench:raw:" + run + ":" + strconv.Itoa(g) + ":"
			parallel(b, g, func(ctx context.Context, i int64) error {
				err := c.Do(ctx, c.B().Set().Key(prefix+strconv.FormatInt(i, 10)).Value("1").Nx().Ex(time.Minute).Build()).Error()
				if rueidis.IsRedisNil(err) {
					return nil
				}
				return err
			})
		})
	}
}

// BenchmarkClaim: our Claim alone (one script call), to compare with the
// raw SET NX EX ceiling at the same concurrency.
func BenchmarkClaim(b *testing.B) {
	s := open(b, standaloneAddrs(b))
	for _, g := range []int{1, 64, 256} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			scope := "bench-claim-" + run + "-" + strconv.Itoa(g)
			parallel(b, g, func(ctx context.Context, i int64) error {
				c, err := s.Claim(ctx, dedup.Key{Scope: scope, ID: strconv.FormatInt(i, 10)}, "", time.Minute)
				if err == nil && c.Outcome != dedup.Acquired {
					err = fmt.Errorf("outcome %v", c.Outcome)
				}
				return err
			})
		})
	}
}

// BenchmarkClaimComplete: the full lifecycle, two round trips per message.
func BenchmarkClaimComplete(b *testing.B) {
	s := open(b, standaloneAddrs(b))
	for _, g := range []int{1, 64, 256} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			scope := "bench-cc-" + run + "-" + strconv.Itoa(g)
			parallel(b, g, func(ctx context.Context, i int64) error {
				c, err := s.Claim(ctx, dedup.Key{Scope: scope, ID: strconv.FormatInt(i, 10)}, "", time.Minute)
				if err != nil {
					return err
				}
				return s.Complete(ctx, c, nil, time.Minute)
			})
		})
	}
}

// BenchmarkClaimBatch100: a broker poll of 100 keys claimed in one round
// trip. One op is one key, so ops/s is keys per second.
func BenchmarkClaimBatch100(b *testing.B) {
	s := open(b, standaloneAddrs(b))
	for _, g := range []int{1, 8} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			scope := "bench-batch-" + run + "-" + strconv.Itoa(g)
			parallel(b, g, func(ctx context.Context, i int64) error {
				if i%100 != 0 {
					return nil
				}
				reqs := make([]dedup.ClaimRequest, 100)
				for j := range reqs {
					reqs[j].Key = dedup.Key{Scope: scope, ID: strconv.FormatInt(i+int64(j), 10)}
				}
				_, err := s.ClaimBatch(ctx, reqs, time.Minute)
				return err
			})
		})
	}
}
