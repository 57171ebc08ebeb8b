package redisstore_test

import (
	"bytes"
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/redis/rueidis"
)

// The record benchmarks run on a private redis-server (so that INFO,
// CONFIG RESETSTAT and FLUSHALL disturb nobody) and compare, in one
// process:
//   - set: a plain SET of "1" (memory) or of a value as long as our
//     completed record (server time), the floor of any Redis dedup;
//   - text: the previous version's text-format record and its complete
//     script (previousCompleteMany below), the baseline this layout
//     replaces;
//   - ours: Claim and Complete / CompleteBatch of this package.
// Keys have the shape of a real one: scope "orders", a UUID as the ID.

func benchServer(b *testing.B) (*testenv.RedisServer, *redisstore.Store) {
	standaloneAddrs(b)
	srv := testenv.StartRedis(b, "")
	return srv, open(b, srv.Addrs())
}

func uuidKey(kind, i int) dedup.Key {
	return dedup.Key{Scope: "orders", ID: fmt.Sprintf("%08x-7e1a-4c3b-9d2e-%012x", kind, i)}
}

// info reads one INFO section as field -> value.
func info(b *testing.B, c rueidis.Client, section string) map[string]string {
	b.Helper()
	v, err := c.Do(context.Background(), c.B().Info().Section(section).Build()).ToString()
	if err != nil {
		b.Fatal(err)
	}
	m := map[string]string{}
	for _, line := range strings.Split(v, "\r\n") {
		if k, val, ok := strings.Cut(line, ":"); ok {
			m[k] = val
		}
	}
	return m
}

// cmdUsec is the total microseconds INFO commandstats gives the named
// commands since the last CONFIG RESETSTAT.
func cmdUsec(b *testing.B, c rueidis.Client, names ...string) float64 {
	stats := info(b, c, "commandstats")
	total := 0.0
	for _, n := range names {
		for _, f := range strings.Split(stats["cmdstat_"+n], ",") {
			if k, v, _ := strings.Cut(f, "="); k == "usec" {
				x, _ := strconv.ParseFloat(v, 64)
				total += x
			}
		}
	}
	return total
}

// cpuSec is the server's CPU time so far (user + system), in seconds.
func cpuSec(b *testing.B, c rueidis.Client) float64 {
	m := info(b, c, "cpu")
	u, _ := strconv.ParseFloat(m["used_cpu_user"], 64)
	s, _ := strconv.ParseFloat(m["used_cpu_sys"], 64)
	return u + s
}

func do(b *testing.B, c rueidis.Client, cmds ...rueidis.Completed) []rueidis.RedisResult {
	b.Helper()
	res := c.DoMulti(context.Background(), cmds...)
	for _, r := range res {
		if err := r.Error(); err != nil && !rueidis.IsRedisNil(err) {
			b.Fatal(err)
		}
	}
	return res
}

// textCompleted is a completed record of the previous text format with
// the given fingerprint and result (attempt 1, an expiry an hour ahead).
func textCompleted(fp dedup.Fingerprint, result []byte) string {
	return textRecord('c', dedup.NewToken(), 1, time.Now().Add(time.Hour).UnixMilli(), fp, string(result))
}

// BenchmarkRecordBytes: memory per completed record with a SHA-256
// fingerprint and a 32-byte result, as MEMORY USAGE reports it (averaged
// over 200 keys) and as the growth of used_memory over n records (which
// adds the expiry table and the hash tables' buckets), against a plain
// SET NX EX "1" on keys of the same length, and against the floor of any
// record keeping the result: a plain SET of the 32-byte result alone.
// Run with -benchtime 1x.
func BenchmarkRecordBytes(b *testing.B) {
	srv, s := benchServer(b)
	c := s.Client()
	ctx := context.Background()
	const n = 50000
	fp := dedup.FingerprintOf([]byte(`{"order":7,"amount":"12.00"}`))
	result := bytes.Repeat([]byte{'r'}, 32)
	cases := []struct {
		name  string
		write func(keys []dedup.Key)
	}{
		{"set", func(keys []dedup.Key) {
			cmds := make(rueidis.Commands, len(keys))
			for i, k := range keys {
				cmds[i] = c.B().Set().Key(s.RedisKey(k)).Value("1").Nx().Ex(time.Hour).Build()
			}
			do(b, c, cmds...)
		}},
		{"result", func(keys []dedup.Key) {
			// the floor of any record that keeps the 32-byte result: the
			// result alone as the value, no state, token or fingerprint
			cmds := make(rueidis.Commands, len(keys))
			for i, k := range keys {
				cmds[i] = c.B().Set().Key(s.RedisKey(k)).Value(string(result)).Nx().PxMilliseconds(time.Hour.Milliseconds()).Build()
			}
			do(b, c, cmds...)
		}},
		{"text", func(keys []dedup.Key) {
			cmds := make(rueidis.Commands, len(keys))
			for i, k := range keys {
				cmds[i] = c.B().Set().Key(s.RedisKey(k)).Value(textCompleted(fp, result)).PxMilliseconds(time.Hour.Milliseconds()).Build()
			}
			do(b, c, cmds...)
		}},
		{"ours", func(keys []dedup.Key) {
			reqs := make([]dedup.ClaimRequest, len(keys))
			for i, k := range keys {
				reqs[i] = dedup.ClaimRequest{Key: k, Fingerprint: fp}
			}
			claims, err := s.ClaimBatch(ctx, reqs, time.Minute)
			if err != nil {
				b.Fatal(err)
			}
			items := make([]dedup.Completion, len(claims))
			for i, cl := range claims {
				items[i] = dedup.Completion{Claim: cl, Result: result}
			}
			errs, err := s.CompleteBatch(ctx, items, time.Hour)
			if err != nil || errs[0] != nil {
				b.Fatal(err, errs[0])
			}
		}},
	}
	for b.Loop() {
		for kind, tc := range cases {
			srv.CLI("flushall")
			before, _ := strconv.ParseFloat(info(b, c, "memory")["used_memory"], 64)
			keys := make([]dedup.Key, 0, 1000)
			for i := range n {
				keys = append(keys, uuidKey(kind, i))
				if len(keys) == cap(keys) {
					tc.write(keys)
					keys = keys[:0]
				}
			}
			after, _ := strconv.ParseFloat(info(b, c, "memory")["used_memory"], 64)
			usage := 0.0
			for i := range 200 {
				u, err := c.Do(ctx, c.B().MemoryUsage().Key(s.RedisKey(uuidKey(kind, i*97))).Build()).AsInt64()
				if err != nil {
					b.Fatal(err)
				}
				usage += float64(u)
			}
			b.ReportMetric(usage/200, tc.name+"-B/record")
			b.ReportMetric((after-before)/n, tc.name+"-used-B/record")
		}
	}
}

// previousCompleteMany is the complete script of the text format, as the
// previous version ran it, for the server-time baseline.
const previousCompleteMany = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function complete(k, tok, res, exp, ret)
	local old = redis.call('GET', k)
	if not old or string.sub(old, 2, 17) ~= tok then return 0 end
	if string.byte(old) == 99 then return 1 end
	local a = string.find(old, ':', 18, true)
	local b = string.find(old, ':', a + 1, true)
	redis.call('SET', k, 'c' .. string.sub(old, 2, a) .. exp .. string.sub(old, b) .. res, 'PX', ret)
	return 1
end
local ret = tonumber(ARGV[1])
local exp = now + ret
local out = {}
for i, k in ipairs(KEYS) do
	out[i] = complete(k, ARGV[2 * i], ARGV[2 * i + 1], exp, ret)
end
return out
`

// previousCompleteOne is the single-key complete script the previous
// version ran for every Complete, for the server-time baseline.
const previousCompleteOne = `
local old = redis.call('GET', KEYS[1])
if not old or string.sub(old, 2, 17) ~= ARGV[1] then return 0 end
local k = string.byte(old)
if k ~= 1 then
	if k == 2 or k == 99 then return 1 end
	return 0
end
local ret = tonumber(ARGV[3])
local t = redis.call('TIME')
local exp = struct.pack('>I6', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ret)
redis.call('PSETEX', KEYS[1], ARGV[3], '\2' .. ARGV[1] .. exp .. string.sub(old, 24) .. ARGV[2])
return 1
`

// previousBatchScript is the batch complete script before the one that
// takes no key twice (it kept what it wrote a key and each key's answer in
// tables, and looked the library functions up a key), for the server-time
// baseline of ours-batch.
const previousBatchScript = `
local ret = tonumber(ARGV[1])
local t = redis.call('TIME')
local exp = struct.pack('>I6', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ret)
local vals = redis.call('MGET', unpack(KEYS))
local out, wrote, lost = {}, {}, false
for i, k in ipairs(KEYS) do
	local old, tok = wrote[k] or vals[i], ARGV[2 * i]
	local r = '0'
	if old and string.find(old, tok, 2, true) == 2 then
		local s = string.byte(old)
		if s == 1 then
			local v = '\2' .. tok .. exp .. string.sub(old, 24) .. ARGV[2 * i + 1]
			redis.call('PSETEX', k, ARGV[1], v)
			wrote[k] = v
			r = '1'
		elseif s == 2 or s == 99 then
			r = '1'
		end
	end
	if r == '0' then lost = true end
	out[i] = r
end
if not lost then return 1 end
return table.concat(out)
`

// BenchmarkCompleteServerTime: Redis server time per completed key, from
// INFO commandstats (usec of the script or SET commands, reset before
// each phase) and from the server's CPU time (which adds reading and
// writing the commands). Cases run interleaved, one round of each per
// b.N, 1024 keys a round, with a SHA-256 fingerprint and a 32-byte
// result:
//   - set: one pipeline of plain SET PX of a 92-byte value (the unfenced
//     floor: a write with no token check);
//   - text-batch: the previous text records and complete script, 128
//     keys a call;
//   - ours-batch: CompleteBatch (128 keys a call);
//   - prev-batch: the previous batch script (previousBatchScript) over
//     the same kind of claims, 128 keys a call, the baseline of
//     ours-batch;
//   - ours-single: Complete from 64 goroutines (coalesced: concurrent
//     calls share script calls);
//   - ours-lone: Complete from one goroutine (one call of the one-key
//     script a key);
//   - set-lone: plain SET PX of a 92-byte value from one goroutine, one
//     at a time (the floor of ours-lone: one unfenced write a key);
//   - single-script: the previous Complete, one script call a key from 64
//     goroutines (previousCompleteOne below), the baseline of ours-single.
func BenchmarkCompleteServerTime(b *testing.B) {
	srv, s := benchServer(b)
	_ = srv
	c := s.Client()
	ctx := context.Background()
	const keys = 1024
	fp := dedup.FingerprintOf([]byte(`{"order":7,"amount":"12.00"}`))
	result := bytes.Repeat([]byte{'r'}, 32)
	value := strings.Repeat("v", 92)
	round := 0
	claim := func(kind int) []dedup.Claim {
		reqs := make([]dedup.ClaimRequest, keys)
		for i := range reqs {
			reqs[i] = dedup.ClaimRequest{Key: uuidKey(kind, round*keys+i), Fingerprint: fp}
		}
		claims, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			b.Fatal(err)
		}
		return claims
	}
	prevSHA, err := c.Do(ctx, c.B().ScriptLoad().Script(previousCompleteMany).Build()).ToString()
	if err != nil {
		b.Fatal(err)
	}
	batchSHA, err := c.Do(ctx, c.B().ScriptLoad().Script(previousBatchScript).Build()).ToString()
	if err != nil {
		b.Fatal(err)
	}
	oneSHA, err := c.Do(ctx, c.B().ScriptLoad().Script(previousCompleteOne).Build()).ToString()
	if err != nil {
		b.Fatal(err)
	}
	// from64 runs op(i) for i in [0, keys) from 64 goroutines.
	from64 := func(op func(i int) error) {
		errc := make(chan error, 64)
		for g := range 64 {
			go func() {
				var err error
				for i := g; i < keys && err == nil; i += 64 {
					err = op(i)
				}
				errc <- err
			}()
		}
		for range 64 {
			if err := <-errc; err != nil {
				b.Fatal(err)
			}
		}
	}
	type phase struct {
		name     string
		cmds     []string // the commands whose usec count
		prepare  func() func()
		usec, cp float64
	}
	phases := []*phase{
		{name: "set", cmds: []string{"set"}, prepare: func() func() {
			cmds := make(rueidis.Commands, keys)
			for i := range cmds {
				cmds[i] = c.B().Set().Key(s.RedisKey(uuidKey(0, round*keys+i))).Value(value).PxMilliseconds(time.Hour.Milliseconds()).Build()
			}
			return func() { do(b, c, cmds...) }
		}},
		{name: "text-batch", cmds: []string{"evalsha"}, prepare: func() func() {
			// Text records in progress, then the previous script over them.
			toks := make([]dedup.Token, keys)
			set := make(rueidis.Commands, keys)
			for i := range set {
				toks[i] = dedup.NewToken()
				set[i] = c.B().Set().Key(s.RedisKey(uuidKey(1, round*keys+i))).Value(textRecord('p', toks[i], 1, 3600000, fp, "")).PxMilliseconds(time.Hour.Milliseconds()).Build()
			}
			do(b, c, set...)
			var cmds rueidis.Commands
			for lo := 0; lo < keys; lo += 128 {
				ks, args := []string{}, []string{"3600000"}
				for i := lo; i < lo+128; i++ {
					ks = append(ks, s.RedisKey(uuidKey(1, round*keys+i)))
					args = append(args, string(toks[i][:]), string(result))
				}
				cmds = append(cmds, c.B().Evalsha().Sha1(prevSHA).Numkeys(int64(len(ks))).Key(ks...).Arg(args...).Build())
			}
			return func() { do(b, c, cmds...) }
		}},
		{name: "ours-batch", cmds: []string{"evalsha", "eval"}, prepare: func() func() {
			claims := claim(2)
			items := make([]dedup.Completion, keys)
			for i, cl := range claims {
				items[i] = dedup.Completion{Claim: cl, Result: result}
			}
			return func() {
				errs, err := s.CompleteBatch(ctx, items, time.Hour)
				if err != nil || errs[0] != nil {
					b.Fatal(err, errs[0])
				}
			}
		}},
		{name: "prev-batch", cmds: []string{"evalsha"}, prepare: func() func() {
			claims := claim(7)
			var cmds rueidis.Commands
			for lo := 0; lo < keys; lo += 128 {
				ks, args := []string{}, []string{"3600000"}
				for _, cl := range claims[lo : lo+128] {
					ks = append(ks, s.RedisKey(cl.Key))
					args = append(args, string(cl.Token[:]), string(result))
				}
				cmds = append(cmds, c.B().Evalsha().Sha1(batchSHA).Numkeys(int64(len(ks))).Key(ks...).Arg(args...).Build())
			}
			return func() {
				for _, r := range do(b, c, cmds...) {
					if n, err := r.AsInt64(); err != nil || n != 1 {
						b.Fatal("previous batch script answered", n, err)
					}
				}
			}
		}},
		{name: "ours-single", cmds: []string{"evalsha", "eval"}, prepare: func() func() {
			claims := claim(3)
			return func() {
				from64(func(i int) error { return s.Complete(ctx, claims[i], result, time.Hour) })
			}
		}},
		{name: "ours-lone", cmds: []string{"evalsha", "eval"}, prepare: func() func() {
			claims := claim(4)
			return func() {
				for _, cl := range claims {
					if err := s.Complete(ctx, cl, result, time.Hour); err != nil {
						b.Fatal(err)
					}
				}
			}
		}},
		{name: "set-lone", cmds: []string{"set"}, prepare: func() func() {
			cmds := make(rueidis.Commands, keys)
			for i := range cmds {
				cmds[i] = c.B().Set().Key(s.RedisKey(uuidKey(6, round*keys+i))).Value(value).PxMilliseconds(time.Hour.Milliseconds()).Build()
			}
			return func() {
				for _, cmd := range cmds {
					do(b, c, cmd)
				}
			}
		}},
		{name: "single-script", cmds: []string{"evalsha"}, prepare: func() func() {
			claims := claim(5)
			return func() {
				from64(func(i int) error {
					cl := claims[i]
					n, err := c.Do(ctx, c.B().Evalsha().Sha1(oneSHA).Numkeys(1).Key(s.RedisKey(cl.Key)).
						Arg(string(cl.Token[:]), string(result), "3600000").Build()).AsInt64()
					if err == nil && n != 1 {
						err = fmt.Errorf("previous complete script answered %d", n)
					}
					return err
				})
			}
		}},
	}
	for b.Loop() {
		for _, p := range phases {
			run := p.prepare()
			if err := c.Do(ctx, c.B().ConfigResetstat().Build()).Error(); err != nil {
				b.Fatal(err)
			}
			cpu0 := cpuSec(b, c)
			run()
			p.cp += cpuSec(b, c) - cpu0
			p.usec += cmdUsec(b, c, p.cmds...)
		}
		round++
	}
	for _, p := range phases {
		b.ReportMetric(p.usec/float64(round*keys), p.name+"-us/key")
		b.ReportMetric(p.cp*1e6/float64(round*keys), p.name+"-cpu-us/key")
	}
}
