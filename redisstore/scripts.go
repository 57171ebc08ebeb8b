package redisstore

import (
	"encoding/binary"
	"encoding/hex"
	"strconv"
	"strings"

	"github.com/dedupkit/dedup"
)

// The Lua scripts below are the whole state machine. Each runs atomically
// on the server (Redis runs one script at a time) and touches exactly one
// key, so it works unchanged on Redis Cluster; completeManyScript, which
// touches several, is only given keys of one hash slot. Time is the
// server's: leases and retention are key TTLs, which the server enforces,
// so clients with skewed clocks agree on when a lease ends.
//
// A record is one binary string with a fixed header (offsets from 0,
// integers big-endian):
//
//	0       kind: 1 in progress, 2 completed
//	1..16   token (16 raw bytes)
//	17..22  n: the hold in ms while in progress, the expiry (server unix
//	        ms) once completed (48 bits)
//	23..26  attempt (32 bits)
//	27      fingerprint code: 255 for a SHA-256 fingerprint of this
//	        package's form ("sha256:" and 64 lower-case hex digits), kept
//	        as its 32 raw bytes; otherwise the length (0 to 128) of the
//	        fingerprint kept as is (0: none)
//	28..    the fingerprint, then the result (completed only)
//
// So the token is always at bytes 1..16 and a script fences a call with
// one fixed-offset comparison; completing copies bytes 23.. (attempt and
// fingerprint) without decoding them. A completed record with a SHA-256
// fingerprint and a 32-byte result is 92 bytes.
//
// Records written before this layout (the text format below) stay
// readable: every reader takes both, and a record is rewritten in the
// binary layout the next time it changes (a take-over); completed text
// records are answered as duplicates until they expire. The text format:
//
//	state (1 byte: 'p' in progress, 'c' completed)
//	token (16 raw bytes)
//	"<attempt>:<n>:<fingerprint length>:" fingerprint
//	result (completed only)
//
// Its token is at the same offset, so the fenced scripts treat both alike.
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

const (
	kindInProgress = 1
	kindCompleted  = 2
	headLen        = 28 // up to and including the fingerprint code
	fpSHA256       = 255
	maxAttempt     = 1<<32 - 1
)

const sha256Prefix = "sha256:"

// encodeFP returns the stored form of fp: its code byte, then its bytes.
// The form is canonical (one fingerprint, one encoding), so two stored
// fingerprints match exactly when their encodings are equal.
func encodeFP(fp dedup.Fingerprint) string {
	if len(fp) == len(sha256Prefix)+64 && strings.HasPrefix(string(fp), sha256Prefix) && isLowerHex(string(fp[len(sha256Prefix):])) {
		var b [33]byte
		b[0] = fpSHA256
		hex.Decode(b[1:], []byte(fp[len(sha256Prefix):]))
		return string(b[:])
	}
	return string(append([]byte{byte(len(fp))}, fp...))
}

func isLowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// fpMatches reports whether two encoded fingerprints match: equal, or
// either is the empty fingerprint (not checked).
func fpMatches(a, b string) bool { return a == "\x00" || b == "\x00" || a == b }

func putUint48(b []byte, v int64) {
	for i := 5; i >= 0; i-- {
		b[i] = byte(v)
		v >>= 8
	}
}

func uint48(b string) int64 {
	var v int64
	for i := range 6 {
		v = v<<8 | int64(b[i])
	}
	return v
}

// recordHead is the in-progress record the client builds for a first
// claim (attempt 1); fpEnc is the encoded fingerprint.
func recordHead(tok *[16]byte, hold int64, fpEnc string) string {
	b := make([]byte, headLen-1, headLen-1+len(fpEnc))
	b[0] = kindInProgress
	copy(b[1:17], tok[:])
	putUint48(b[17:23], hold)
	binary.BigEndian.PutUint32(b[23:27], 1)
	return string(append(b, fpEnc...))
}

// luaCodec holds the claim script's helpers: encfp encodes a text-format
// fingerprint as encodeFP does; decode splits a record of either format
// into (completed, attempt, n, encoded fingerprint, offset of the
// result). Integers are read and written with Redis's struct library.
const luaCodec = `
local function encfp(f)
	if #f == 71 and string.sub(f, 1, 7) == 'sha256:' and not string.find(f, '[^0-9a-f]', 8) then
		return '\255' .. (string.gsub(string.sub(f, 8), '..', function(h) return string.char(tonumber(h, 16)) end))
	end
	return string.char(#f) .. f
end
local function decode(v)
	local k = string.byte(v, 1)
	if k == 1 or k == 2 then
		local fl = string.byte(v, 28)
		if fl == 255 then fl = 32 end
		return k == 2, struct.unpack('>I4', v, 24), struct.unpack('>I6', v, 18), string.sub(v, 28, 28 + fl), 29 + fl
	end
	local a, h, fl, pos = string.match(v, '^(%d+):(%d+):(%d+):()', 18)
	fl = tonumber(fl)
	return k == 99, tonumber(a), tonumber(h), encfp(string.sub(v, pos, pos + fl - 1)), pos + fl
end
`

// luaExpiry sets exp to the 6-byte expiry field of a record completed now
// (server time) with retention ret ms.
const luaExpiry = `
local t = redis.call('TIME')
local exp = struct.pack('>I6', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ret)
`

// claimScript: KEYS[1] record; ARGV[1] the new record (attempt 1),
// ARGV[2] token, ARGV[3] lease ms, ARGV[4] hold ms, ARGV[5] encoded
// fingerprint. Returns {code, attempt, ms left[, result]}: code 1 acquired
// (attempt negative for a take-over), 2 in progress, 3 duplicate, 4
// mismatch. A take-over writes the binary layout, whatever it found.
const claimScript = luaCodec + `
local lease, hold = tonumber(ARGV[3]), tonumber(ARGV[4])
local old = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'GET', 'PX', lease + hold)
if not old then return {1, 1, lease} end
local done, a, h, f, rest = decode(old)
local fp = ARGV[5]
if fp ~= '\0' and f ~= '\0' and f ~= fp then return {4, a, 0} end
local ttl = redis.call('PTTL', KEYS[1])
if done then return {3, a, ttl, string.sub(old, rest)} end
if ttl - h > 0 then return {2, a, ttl - h} end
if f ~= '\0' then fp = f end
if a < 4294967295 then a = a + 1 end
redis.call('SET', KEYS[1], '\1' .. ARGV[2] .. struct.pack('>I6I4', hold, a) .. fp, 'PX', lease + hold)
return {1, -a, lease}
`

// completeManyScript completes several records of one slot in one call:
// KEYS; ARGV[1] retention ms, then for KEYS[i] ARGV[2i] its token and
// ARGV[2i+1] its result. No key may appear twice in one call (groups
// starts another call for a repeated key; completeItems sends a claim
// once, so the calls of one key carry different tokens, which no order
// of the calls can make both match). Each
// key's token is compared at its fixed offset (a plain find that must
// match at byte 2, which builds no substring): a missing record or another
// token is lease lost, a record this token already completed is done
// again with no change. The completed record is the kind, the token, the
// expiry, the in-progress record's bytes from the attempt on (copied, not
// decoded) and the result. One MGET for all of them and one clock read. It
// returns the integer 1 when every key was done, else a string of one
// byte a key, in order: '1' done, '0' lease lost (one reply to encode and
// parse, not one a key); the table behind that string is only built once
// a key is lost. PSETEX is SET PX with one argument fewer to convert. The
// library functions are locals and the loop is a numeric for (no ipairs
// call a key): with no per-key table writes, 7.8% fewer server
// instructions a key than the version with them under callgrind. Per key
// the script's time goes mostly to the write's redis.call (converting its
// arguments and reply, and PSETEX itself), the MGET and the arguments
// (measured in BenchmarkCompleteServerTime).
const completeManyScript = `
local call, find, byte, sub = redis.call, string.find, string.byte, string.sub
local ret = tonumber(ARGV[1])
` + luaExpiry + `
local vals = call('MGET', unpack(KEYS))
local out
for i = 1, #KEYS do
	local old, tok = vals[i], ARGV[2 * i]
	local ok = false
	if old and find(old, tok, 2, true) == 2 then
		local s = byte(old)
		if s == 1 then
			call('PSETEX', KEYS[i], ARGV[1], '\2' .. tok .. exp .. sub(old, 24) .. ARGV[2 * i + 1])
			ok = true
		elseif s == 2 or s == 99 then
			ok = true
		end
	end
	if not ok and not out then
		out = {}
		for j = 1, i - 1 do out[j] = '1' end
	end
	if out then out[i] = ok and '1' or '0' end
end
if not out then return 1 end
return table.concat(out)
`

// completeOneScript completes one record: KEYS[1]; ARGV[1] its token,
// ARGV[2] its result, ARGV[3] retention ms. It decides exactly as
// completeManyScript does for one key (the same fixed-offset token check,
// the same completed record, expiry from the server's clock) and answers
// as it does: the integer 1 done, the string '0' lease lost. It is what a
// group of one key is sent as (a lone Complete, a cluster batch's key
// alone in its slot): with no MGET, unpack, tables or concat of replies,
// it costs the server 11% fewer instructions than completeManyScript
// given one key (56.6-56.9k against 63.5k a call under callgrind, where a
// plain SET is 10.7-10.9k).
const completeOneScript = `
local old = redis.call('GET', KEYS[1])
if not old or string.find(old, ARGV[1], 2, true) ~= 2 then return '0' end
local s = string.byte(old)
if s == 1 then
	local ret = tonumber(ARGV[3])
` + luaExpiry + `
	redis.call('PSETEX', KEYS[1], ARGV[3], '\2' .. ARGV[1] .. exp .. string.sub(old, 24) .. ARGV[2])
	return 1
end
if s == 2 or s == 99 then return 1 end
return '0'
`

// releaseScript: KEYS[1]; ARGV[1] token. Returns 1 released, 0 lease lost.
const releaseScript = `
local old = redis.call('GET', KEYS[1])
if not old or string.sub(old, 1, 17) ~= '\1' .. ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
`

// extendScript: KEYS[1]; ARGV[1] token, ARGV[2] lease ms. Returns 1, or 0
// for lease lost.
const extendScript = `
local old = redis.call('GET', KEYS[1])
if not old or string.sub(old, 1, 17) ~= '\1' .. ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) + struct.unpack('>I6', old, 18))
return 1
`

// record is a record string split into its parts.
type record struct {
	completed bool
	attempt   int64
	n         int64  // hold ms (in progress) or expiry unix ms (completed)
	fpEnc     string // encoded as encodeFP does
	result    string
}

// parseRecord splits v, in either format; ok is false for a value this
// package did not write.
func parseRecord(v string) (r record, ok bool) {
	if len(v) >= headLen && (v[0] == kindInProgress || v[0] == kindCompleted) {
		fl := int(v[27])
		if fl == fpSHA256 {
			fl = 32
		} else if fl > dedup.MaxFingerprintBytes {
			return r, false
		}
		if len(v) < headLen+fl {
			return r, false
		}
		r.completed = v[0] == kindCompleted
		r.n = uint48(v[17:23])
		r.attempt = int64(v[23])<<24 | int64(v[24])<<16 | int64(v[25])<<8 | int64(v[26])
		r.fpEnc, r.result = v[27:headLen+fl], v[headLen+fl:]
		return r, true
	}
	return parseTextRecord(v)
}

// parseTextRecord splits a record of the text format.
func parseTextRecord(v string) (r record, ok bool) {
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
	r.fpEnc, r.result = encodeFP(dedup.Fingerprint(rest[:nums[2]])), rest[nums[2]:]
	return r, true
}
