package outbox_test

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/outbox"
)

func TestValidate(t *testing.T) {
	good := outbox.Message{ID: "billing:evt-1", Topic: "payments.captured", Key: "invoice/42", Payload: []byte("{}"),
		Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, m := range map[string]outbox.Message{
		"no topic":        {},
		"topic space":     {Topic: "a b"},
		"long topic":      {Topic: strings.Repeat("t", outbox.MaxTopicLen+1)},
		"ID control":      {Topic: "t", ID: "a\x01"},
		"long ID":         {Topic: "t", ID: strings.Repeat("i", outbox.MaxIDLen+1)},
		"key bad UTF-8":   {Topic: "t", Key: "\xff"},
		"long key":        {Topic: "t", Key: strings.Repeat("k", outbox.MaxKeyLen+1)},
		"header colon":    {Topic: "t", Headers: map[string]string{"a:b": "v"}},
		"header newline":  {Topic: "t", Headers: map[string]string{"a": "v\n"}},
		"too big payload": {Topic: "t", Payload: make([]byte, outbox.MaxPayloadSize+1)},
	} {
		var ae *dedup.ArgumentError
		if err := m.Validate(); !errors.As(err, &ae) || !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: %v, want an *ArgumentError", name, err)
		}
	}
	var nilMsg *outbox.Message
	if err := nilMsg.Validate(); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("nil message: %v", err)
	}
}

var uuid7 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

func TestNewID(t *testing.T) {
	seen := map[string]bool{}
	prev := ""
	for range 1000 {
		id := outbox.NewID("")
		if !uuid7.MatchString(id) || seen[id] {
			t.Fatalf("NewID = %q (seen before: %v)", id, seen[id])
		}
		if id[:13] < prev[:min(len(prev), 13)] {
			t.Fatalf("time prefix went back: %s after %s", id, prev)
		}
		seen[id], prev = true, id
	}
	if id := outbox.NewID("billing"); !strings.HasPrefix(id, "billing:") || !uuid7.MatchString(id[8:]) {
		t.Fatalf("namespaced ID %q", id)
	}
	m := outbox.Message{Topic: "t"}
	if err := outbox.Prepare(&m); err != nil || !uuid7.MatchString(m.ID) {
		t.Fatalf("Prepare: %q, %v", m.ID, err)
	}
	keep := outbox.Message{Topic: "t", ID: "mine"}
	if outbox.Prepare(&keep); keep.ID != "mine" {
		t.Fatal("Prepare replaced an ID")
	}
}

func TestPermanent(t *testing.T) {
	base := errors.New("too large")
	p := outbox.Permanent(base)
	if !outbox.IsPermanent(p) || !errors.Is(p, base) || !outbox.IsPermanent(fmt.Errorf("wrapped: %w", p)) {
		t.Fatal("Permanent is not recognised through wrapping")
	}
	if outbox.IsPermanent(base) || outbox.Permanent(nil) != nil || outbox.IsPermanent(outbox.ErrNotSent) {
		t.Fatal("a transient error is permanent")
	}
}

func ExampleNewID() {
	id := outbox.NewID("billing")
	fmt.Println(strings.HasPrefix(id, "billing:"), len(id))
	// Output: true 44
}
