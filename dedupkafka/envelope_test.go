package dedupkafka

import (
	"errors"
	"testing"
	"unsafe"

	"github.com/twmb/franz-go/pkg/kgo"
)

func TestEnvelope(t *testing.T) {
	r := &kgo.Record{Topic: "orders", Partition: 2, Offset: 7, Key: []byte("order/42"), Value: []byte("x"),
		Headers: []kgo.RecordHeader{{Key: HeaderVersion, Value: []byte("3")}, {Key: "trace", Value: []byte("a")}, {Key: "trace", Value: []byte("b")}}}
	m, err := newMessage(r, 1)
	if err != nil {
		t.Fatal(err)
	}
	if m.ID != "orders/2/7" || m.Aggregate != "order/42" || m.Version != 3 || m.Headers["trace"] != "a" || m.Headers[HeaderKafkaKey] != "order/42" {
		t.Fatalf("message %+v", m)
	}
	// The republished record keeps the derived ID, the key, the headers.
	back := recordOf(m)
	if string(back.Key) != "order/42" || back.Topic != "orders" {
		t.Fatalf("record %+v", back)
	}
	m2, _ := newMessage(&kgo.Record{Topic: "orders", Offset: 99, Key: back.Key, Headers: back.Headers}, 1)
	if m2.ID != m.ID || m2.Version != 3 {
		t.Fatalf("republished message %+v, want the ID %s", m2, m.ID)
	}
	r.Headers = []kgo.RecordHeader{{Key: HeaderVersion, Value: []byte("v3")}}
	var he *HeaderError
	if _, err := newMessage(r, 1); !errors.As(err, &he) || he.Header != HeaderVersion {
		t.Fatalf("bad version: %v", err)
	}
}

// TestEnvelopeHeaders: the first value of a repeated header counts, for
// the named ones too; the source is always the record's own; a record key
// is the aggregate only without an aggregate header.
func TestEnvelopeHeaders(t *testing.T) {
	r := &kgo.Record{Topic: "t", Partition: 1, Offset: 5, Key: []byte("k"), Headers: []kgo.RecordHeader{
		{Key: HeaderMsgID, Value: []byte("m1")}, {Key: HeaderMsgID, Value: []byte("m2")},
		{Key: HeaderBusinessKey, Value: []byte("b1")}, {Key: HeaderBusinessKey, Value: []byte("b2")},
		{Key: HeaderAggregate, Value: []byte("a1")}, {Key: HeaderAggregate, Value: []byte("a2")},
		{Key: HeaderVersion, Value: []byte(" 4 ")}, {Key: HeaderVersion, Value: []byte("x")},
		{Key: HeaderKafkaSource, Value: []byte("forged/0/0")}}}
	m, err := newMessage(r, 2)
	if err != nil {
		t.Fatal(err)
	}
	if m.ID != "m1" || m.BusinessKey != "b1" || m.Aggregate != "a1" || m.Version != 4 || m.Delivery != 2 ||
		m.Headers[HeaderKafkaSource] != "t/1/5" || m.Headers[HeaderKafkaKey] != "k" || m.Headers[HeaderMsgID] != "m1" {
		t.Fatalf("message %+v", m)
	}
	// An empty message ID header: the source is the ID.
	r.Headers = []kgo.RecordHeader{{Key: HeaderMsgID}, {Key: HeaderMsgID, Value: []byte("m2")}}
	if m, _ = newMessage(r, 1); m.ID != "t/1/5" || m.Aggregate != "k" {
		t.Fatalf("message %+v", m)
	}
}

// TestEnvelopeIDOwnsItsBytes: a store keeps the ID's string for the
// retention (memstore does not copy it), so an ID made from the source
// must not share the allocation the source and the record key are cut
// from, or every kept key would keep the record key too.
func TestEnvelopeIDOwnsItsBytes(t *testing.T) {
	r := &kgo.Record{Topic: "t", Partition: 1, Offset: 5, Key: make([]byte, 100)}
	m, err := newMessage(r, 1)
	if err != nil {
		t.Fatal(err)
	}
	if m.ID != "t/1/5" {
		t.Fatalf("ID %q", m.ID)
	}
	src, key := unsafe.StringData(m.Headers[HeaderKafkaSource]), unsafe.StringData(m.Headers[HeaderKafkaKey])
	if id := unsafe.StringData(m.ID); id == src || id == key {
		t.Fatal("the ID shares the bytes of the source and the record key")
	}
}

// FuzzEnvelope: any headers parse to a message or a HeaderError, never a
// panic, and a message's republished record reads back to the same IDs.
func FuzzEnvelope(f *testing.F) {
	f.Add("m1", "k", "7", "biz", []byte("key"))
	f.Add("", "", "x", "", []byte(nil))
	f.Fuzz(func(t *testing.T, id, agg, version, biz string, key []byte) {
		r := &kgo.Record{Topic: "t", Key: key, Headers: []kgo.RecordHeader{
			{Key: HeaderMsgID, Value: []byte(id)}, {Key: HeaderAggregate, Value: []byte(agg)},
			{Key: HeaderVersion, Value: []byte(version)}, {Key: HeaderBusinessKey, Value: []byte(biz)}}}
		m, err := newMessage(r, 1)
		if err != nil {
			var he *HeaderError
			if !errors.As(err, &he) {
				t.Fatalf("error %v is not a HeaderError", err)
			}
			return
		}
		m2, err := newMessage(recordOf(m), 1)
		if err != nil || m2.ID != m.ID || m2.BusinessKey != m.BusinessKey || m2.Version != m.Version || m2.Aggregate != m.Aggregate {
			t.Fatalf("round trip: %+v -> %+v (%v)", m, m2, err)
		}
	})
}

// BenchmarkNewMessage is the envelope's cost a record (the adapter's
// per-record work besides the processor), with a message ID header and a
// record key.
func BenchmarkNewMessage(b *testing.B) {
	r := &kgo.Record{Topic: "orders", Partition: 3, Offset: 1234567, Key: []byte("k17"), Value: make([]byte, 128),
		Headers: []kgo.RecordHeader{{Key: HeaderMsgID, Value: []byte("orders-1234567")}}}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := newMessage(r, 1); err != nil {
			b.Fatal(err)
		}
	}
}
