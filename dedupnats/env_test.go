package dedupnats

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// defaultNATSURL is the server tests use when DEDUP_NATS_URL is not set.
const defaultNATSURL = "nats://127.0.0.1:4222"

func natsURL() string {
	if v := os.Getenv("DEDUP_NATS_URL"); v != "" {
		return v
	}
	return defaultNATSURL
}

// connect returns a connection of the test's own (closed when it ends) and
// its JetStream context. A server that does not answer, or has no
// JetStream, skips the test naming DEDUP_NATS_URL, or fails it under
// DEDUP_REQUIRE_SERVICES=1.
func connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	url := natsURL()
	missing := func(err error) {
		t.Helper()
		msg := fmt.Sprintf("NATS JetStream is not reachable at %s (%v); set DEDUP_NATS_URL to its address", url, err)
		if os.Getenv("DEDUP_REQUIRE_SERVICES") == "1" {
			t.Fatal(msg + " (DEDUP_REQUIRE_SERVICES=1: a missing service is a failure)")
		}
		t.Skip(msg)
	}
	nc, err := nats.Connect(url, nats.Timeout(3*time.Second), nats.Name("dedupnats-test "+t.Name()))
	if err != nil {
		missing(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		missing(fmt.Errorf("JetStream: %w", err))
	}
	return nc, js
}

// uniqueName returns a stream or consumer name made of the test's name and
// a random suffix, so tests run in parallel and again without clashing.
func uniqueName(t testing.TB, suffix string) string {
	name := strings.Map(func(r rune) rune {
		switch {
		case 'a' <= r && r <= 'z', 'A' <= r && r <= 'Z', '0' <= r && r <= '9':
			return r
		}
		return '_'
	}, t.Name())
	if len(name) > 40 {
		name = name[:40]
	}
	return fmt.Sprintf("T_%s_%s%08x", name, suffix, rand.Uint32())
}

// newStream creates a memory stream of the test's own on subjects
// "<name>.>", deleted when the test ends; adjust may change its config.
func newStream(t testing.TB, js jetstream.JetStream, adjust ...func(*jetstream.StreamConfig)) string {
	t.Helper()
	name := uniqueName(t, "")
	cfg := jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: jetstream.MemoryStorage}
	for _, f := range adjust {
		f(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		t.Fatalf("create stream %s: %v", name, err)
	}
	deleteStreamOnCleanup(t, name)
	return name
}

func deleteStreamOnCleanup(t testing.TB, name string) {
	t.Cleanup(func() {
		// The test's own connection may be closed by now (a crash test).
		nc, err := nats.Connect(natsURL(), nats.Timeout(3*time.Second))
		if err != nil {
			t.Errorf("delete stream %s: %v", name, err)
			return
		}
		defer nc.Close()
		js, _ := jetstream.New(nc)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := js.DeleteStream(ctx, name); err != nil && !strings.Contains(err.Error(), "not found") {
			t.Errorf("delete stream %s: %v", name, err)
		}
	})
}
