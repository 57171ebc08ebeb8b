package deduphttp

import (
	"bufio"
	"encoding/binary"
	"errors"
	"net"
	"net/http"
	"strconv"
)

// recordVersion is the first byte of an encoded response.
const recordVersion = 1

// storedResponse is what Complete stores for a request: the status, the
// allowlisted headers and the body.
type storedResponse struct {
	status int
	header http.Header
	body   []byte
}

// encode lays r out as: version byte, status (2 bytes big-endian), number
// of header values (uvarint), each as name and value (uvarint length then
// bytes), then the body to the end.
func (r *storedResponse) encode() []byte {
	n := 3 + binary.MaxVarintLen64 + len(r.body)
	for k, vs := range r.header {
		for _, v := range vs {
			n += 2*binary.MaxVarintLen64 + len(k) + len(v)
		}
	}
	b := make([]byte, 0, n)
	b = append(b, recordVersion, byte(r.status>>8), byte(r.status))
	count := 0
	for _, vs := range r.header {
		count += len(vs)
	}
	b = binary.AppendUvarint(b, uint64(count))
	for k, vs := range r.header {
		for _, v := range vs {
			b = binary.AppendUvarint(b, uint64(len(k)))
			b = append(b, k...)
			b = binary.AppendUvarint(b, uint64(len(v)))
			b = append(b, v...)
		}
	}
	return append(b, r.body...)
}

var errCorrupt = errors.New("deduphttp: stored response is corrupt")

// decodeResponse is the inverse of encode. It never panics on bad input.
func decodeResponse(b []byte) (storedResponse, error) {
	var r storedResponse
	if len(b) < 3 || b[0] != recordVersion {
		return r, errCorrupt
	}
	r.status = int(b[1])<<8 | int(b[2])
	if r.status < 100 || r.status > 999 {
		return r, errCorrupt
	}
	b = b[3:]
	count, n := binary.Uvarint(b)
	if n <= 0 || count > uint64(len(b)) {
		return r, errCorrupt
	}
	b = b[n:]
	r.header = make(http.Header, count)
	str := func() (string, bool) {
		l, n := binary.Uvarint(b)
		if n <= 0 || l > uint64(len(b)-n) {
			return "", false
		}
		s := string(b[n : n+int(l)])
		b = b[n+int(l):]
		return s, true
	}
	for range count {
		k, ok := str()
		if !ok {
			return r, errCorrupt
		}
		v, ok := str()
		if !ok {
			return r, errCorrupt
		}
		r.header[k] = append(r.header[k], v)
	}
	r.body = b
	return r, nil
}

// recorder passes a handler's response through to the client while keeping
// a copy of its status, allowlisted headers and body (up to a limit) for
// storage. A client that stops reading does not stop the recording: once a
// write to the client fails, later writes only record, so the handler (a
// reverse proxy copying its upstream's answer) runs to the end and the
// response can be stored for the client's retry.
type recorder struct {
	w          http.ResponseWriter
	m          *Middleware
	status     int
	header     http.Header
	body       []byte
	overflow   bool
	hijacked   bool
	clientGone bool
	outcome    Outcome
}

func (r *recorder) Header() http.Header { return r.w.Header() }

func (r *recorder) WriteHeader(code int) {
	if r.status != 0 {
		r.w.WriteHeader(code) // superfluous; net/http logs it
		return
	}
	if code < 200 {
		r.w.WriteHeader(code) // informational: not the final status
		return
	}
	r.status = code
	h := r.w.Header()
	for _, name := range r.m.cfg.replayHeaders {
		if vs := h[name]; len(vs) > 0 {
			if r.header == nil {
				r.header = make(http.Header, len(r.m.cfg.replayHeaders))
			}
			r.header[name] = append([]string(nil), vs...)
		}
	}
	if r.willStore(h, code) {
		r.m.setExpires(h, r.m.now().Add(r.m.cfg.retention))
	}
	r.w.WriteHeader(code)
}

// willStore reports whether a response is sure, when its header is sent,
// to be stored if the handler finishes: a finished outcome, a status the
// policy stores, and a declared length within the stored-body limit. Only
// then does the first response carry the expiry header.
func (r *recorder) willStore(h http.Header, code int) bool {
	if r.outcome != OutcomeFinished || !r.m.cfg.storeStatus(code) {
		return false
	}
	cl := h["Content-Length"]
	if len(cl) != 1 {
		return false
	}
	n, err := strconv.ParseInt(cl[0], 10, 64)
	return err == nil && n >= 0 && n <= int64(r.m.cfg.maxStoredBody)
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	if !r.overflow {
		if len(r.body)+len(p) > r.m.cfg.maxStoredBody {
			r.overflow, r.body = true, nil
		} else {
			r.body = append(r.body, p...)
		}
	}
	if r.clientGone {
		if r.overflow {
			return 0, errClientGone
		}
		return len(p), nil
	}
	n, err := r.w.Write(p)
	if err != nil {
		r.clientGone = true
		if !r.overflow {
			return len(p), nil
		}
	}
	return n, err
}

var errClientGone = errors.New("deduphttp: the client is gone and the response is too large to store")

// Flush sends buffered data to the client, for handlers that assert
// http.Flusher.
func (r *recorder) Flush() {
	if r.status == 0 {
		r.WriteHeader(http.StatusOK)
	}
	if !r.clientGone {
		_ = http.NewResponseController(r.w).Flush()
	}
}

// Hijack hands the connection to the handler; the response is then not
// recorded, and the key is held until its lease ends.
func (r *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	r.hijacked = true
	return http.NewResponseController(r.w).Hijack()
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (r *recorder) Unwrap() http.ResponseWriter { return r.w }
