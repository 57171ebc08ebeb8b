package main

import (
	"strings"
	"testing"
)

// TestLogBufferKeepsOrderAndFlushes: lines come out whole and in order,
// on Flush, and everything queued is written by Close; a line written
// after Close is written at once.
func TestLogBufferKeepsOrderAndFlushes(t *testing.T) {
	var out syncBuffer
	b := newLogBuffer(&out)
	b.Write([]byte("one\n"))
	b.Write([]byte("two\n"))
	b.Flush()
	if got := out.String(); got != "one\ntwo\n" {
		t.Fatalf("after Flush: %q", got)
	}
	big := strings.Repeat("x", logFlushBytes) + "\n"
	b.Write([]byte(big)) // a full buffer is written without waiting
	if got := out.String(); got != "one\ntwo\n"+big {
		t.Fatalf("a full buffer was not written at once (%d bytes out)", len(got))
	}
	b.Write([]byte("three\n"))
	b.Close()
	b.Write([]byte("four\n"))
	if got := out.String(); !strings.HasSuffix(got, big+"three\nfour\n") {
		t.Fatalf("after Close: %q", got[len(got)-20:])
	}
}

// TestBufferPoolDoesNotAllocate: the reverse proxy's copy buffers come
// from the pool without an allocation per response.
func TestBufferPoolDoesNotAllocate(t *testing.T) {
	p := newBufferPool()
	p.Put(p.Get())
	if n := testing.AllocsPerRun(1000, func() {
		b := p.Get()
		if len(b) != proxyBuffer {
			t.Fatalf("buffer of %d bytes", len(b))
		}
		p.Put(b)
	}); n > 0 {
		t.Fatalf("%v allocations per Get and Put, want 0", n)
	}
}
