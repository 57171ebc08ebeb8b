package redisstore

import "strconv"

// The Lua scripts below are the whole state machine. Each runs atomically
// on the server (Redis runs one script at a time) and touches exactly one
// key, so it works unchanged on Redis Cluster; completeManyScript, which
// touches several, is only given keys of one hash slot. Time is the server's: leases
// and retention are key TTLs, which the server enforces, so clients with
// skewed clocks agree on when a lease ends.
//
// A record is one string:
//
//	state (1 byte: 'p' in progress, 'c' completed)
//	token (16 raw bytes)
//	"<attempt>:<n>:<fingerprint length>:" fingerprint
//	result (completed only)
//
// where n is the hold in ms while in progress and the expiry (server unix
// ms) once completed.
//
// While in progress the key's TTL is the lease plus the hold, so the lease
// is live while PTTL > hold, and an expired lease can still be taken over
// with attempt + 1 (and a claim with another fingerprint refused) until the
// hold runs out. Once completed the TTL is exactly the retention.
//
// Claim first sends a plain SET NX GET PX (see Store.Claim): absent keys,
// duplicates and mismatches are decided by that one atomic command; only a
// key found in progress with a matching fingerprint goes on to claimScript,
// which decides live lease or take-over atomically.

// recordHead is the part of an in-progress record the client builds for a
// first claim (attempt 1).
func recordHead(tok *[16]byte, hold int64, fp string) string {
	return "p" + string(tok[:]) + "1:" + strconv.FormatInt(hold, 10) + ":" + strconv.Itoa(len(fp)) + ":" + fp
}

const luaNow = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
`

const parse = `
local function parse(v)
	local a, h, fl, pos = string.match(v, '^(%d+):(%d+):(%d+):()', 18)
	fl = tonumber(fl)
	return string.sub(v, 1, 1), string.sub(v, 2, 17), tonumber(a), tonumber(h), string.sub(v, pos, pos + fl - 1), pos + fl
end
`

// claimScript: KEYS[1] record; ARGV[1] the new record (attempt 1),
// ARGV[2] token, ARGV[3] lease ms, ARGV[4] hold ms, ARGV[5] fingerprint.
// Returns {code, attempt, ms left[, result]}: code 1 acquired (attempt
// negative for a take-over), 2 in progress, 3 duplicate, 4 mismatch.
const claimScript = parse + `
local lease, hold = tonumber(ARGV[3]), tonumber(ARGV[4])
local old = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'GET', 'PX', lease + hold)
if not old then return {1, 1, lease} end
local state, _, a, h, f, rest = parse(old)
local fp = ARGV[5]
if fp ~= '' and f ~= '' and f ~= fp then return {4, a, 0} end
local ttl = redis.call('PTTL', KEYS[1])
if state == 'c' then return {3, a, ttl, string.sub(old, rest)} end
if ttl - h > 0 then return {2, a, ttl - h} end
if f ~= '' then fp = f end
a = a + 1
redis.call('SET', KEYS[1], 'p' .. ARGV[2] .. a .. ':' .. hold .. ':' .. #fp .. ':' .. fp, 'PX', lease + hold)
return {1, -a, lease}
`

// completeFn completes the record at k for token tok with result res,
// expiring at exp (server unix ms) after ret ms: 1 done (or already done
// by this token), 0 lease lost. It rewrites the in-progress record's head
// in place (state, and the hold replaced by the expiry) with two plain
// string searches instead of parsing it: the script's cost is mostly its
// own string work, besides the GET and the SET.
const completeFn = `
local function complete(k, tok, res, exp, ret)
	local old = redis.call('GET', k)
	if not old or string.sub(old, 2, 17) ~= tok then return 0 end
	if string.byte(old) == 99 then return 1 end
	local a = string.find(old, ':', 18, true)
	local b = string.find(old, ':', a + 1, true)
	redis.call('SET', k, 'c' .. string.sub(old, 2, a) .. exp .. string.sub(old, b) .. res, 'PX', ret)
	return 1
end
`

// completeScript: KEYS[1]; ARGV[1] token, ARGV[2] result, ARGV[3]
// retention ms. Returns 1 done (or already done by this token), 0 lease lost.
const completeScript = luaNow + completeFn + `
local ret = tonumber(ARGV[3])
return complete(KEYS[1], ARGV[1], ARGV[2], now + ret, ret)
`

// completeManyScript completes several records of one slot in one call:
// KEYS; ARGV[1] retention ms, then for KEYS[i] ARGV[2i] its token and
// ARGV[2i+1] its result. Each key as completeScript; returns the array of
// their answers, in order.
const completeManyScript = luaNow + completeFn + `
local ret = tonumber(ARGV[1])
local exp = now + ret
local out = {}
for i, k in ipairs(KEYS) do
	out[i] = complete(k, ARGV[2 * i], ARGV[2 * i + 1], exp, ret)
end
return out
`

// releaseScript: KEYS[1]; ARGV[1] token. Returns 1 released, 0 lease lost.
const releaseScript = `
local old = redis.call('GET', KEYS[1])
if not old or string.sub(old, 1, 17) ~= 'p' .. ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
`

// extendScript: KEYS[1]; ARGV[1] token, ARGV[2] lease ms. Returns 1, or 0
// for lease lost.
const extendScript = parse + `
local old = redis.call('GET', KEYS[1])
if not old or string.sub(old, 1, 17) ~= 'p' .. ARGV[1] then return 0 end
local _, _, _, h = parse(old)
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + h)
return 1
`

// record is a record string split into its parts.
type record struct {
	completed bool
	attempt   int64
	n         int64 // hold ms (in progress) or expiry unix ms (completed)
	fp        string
	result    string
}

// parseRecord splits v; ok is false for a value this package did not write.
func parseRecord(v string) (r record, ok bool) {
	if len(v) < 17 || (v[0] != 'p' && v[0] != 'c') {
		return r, false
	}
	r.completed = v[0] == 'c'
	rest := v[17:]
	var nums [3]int64
	for i := range nums {
		j := 0
		for j < len(rest) && rest[j] != ':' {
			j++
		}
		n, err := strconv.ParseInt(rest[:j], 10, 64)
		if err != nil || j == len(rest) {
			return r, false
		}
		nums[i], rest = n, rest[j+1:]
	}
	if nums[2] < 0 || nums[2] > int64(len(rest)) {
		return r, false
	}
	r.attempt, r.n = nums[0], nums[1]
	r.fp, r.result = rest[:nums[2]], rest[nums[2]:]
	return r, true
}
