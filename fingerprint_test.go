package dedup_test

import (
	"errors"
	"fmt"
	"hash/adler32"
	"testing"

	"github.com/dedupkit/dedup"
)

func TestFingerprintOfIsSHA256(t *testing.T) {
	// SHA-256("abc"), from FIPS 180-2.
	const want = "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
	if got := dedup.FingerprintOf([]byte("abc")); got != want {
		t.Fatalf("FingerprintOf(abc) = %s", got)
	}
}

// TestFingerprintSequentialIDsDoNotCollide is the failure of a weak
// checksum: JSON bodies that differ only in a sequential id collide under
// Adler-32 far more often than chance. Under SHA-256 none may.
func TestFingerprintSequentialIDsDoNotCollide(t *testing.T) {
	const n = 100_000
	seen := make(map[dedup.Fingerprint]int, n)
	adler := make(map[uint32]int, n)
	adlerCollisions := 0
	for i := range n {
		body := []byte(fmt.Sprintf(`{"id":%d,"type":"charge","amount":100}`, i))
		fp := dedup.FingerprintOf(body)
		if j, ok := seen[fp]; ok {
			t.Fatalf("bodies %d and %d share fingerprint %s", j, i, fp)
		}
		seen[fp] = i
		a := adler32.Checksum(body)
		if _, ok := adler[a]; ok {
			adlerCollisions++
		}
		adler[a] = i
	}
	if adlerCollisions == 0 {
		t.Fatal("expected the Adler-32 baseline to collide on sequential ids; the comparison is meaningless otherwise")
	}
	t.Logf("%d payloads: 0 SHA-256 collisions, %d Adler-32 collisions", n, adlerCollisions)
}

func TestFingerprintParts(t *testing.T) {
	if dedup.FingerprintParts([]byte("ab"), []byte("c")) == dedup.FingerprintParts([]byte("a"), []byte("bc")) {
		t.Fatal("part boundaries are lost")
	}
	if dedup.FingerprintParts([]byte("x")) != dedup.FingerprintParts([]byte("x")) {
		t.Fatal("not stable")
	}
}

func TestFingerprintJSONCanonical(t *testing.T) {
	a, err := dedup.FingerprintJSON([]byte(`{"b":1,"a":{"y":2,"x":[1,2]}}`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := dedup.FingerprintJSON([]byte("{ \"a\" : {\"x\":[1, 2], \"y\":2},\n\"b\":1 }"))
	if a != b {
		t.Fatal("key order and spacing changed the fingerprint")
	}
	c, _ := dedup.FingerprintJSON([]byte(`{"b":1,"a":{"y":2,"x":[2,1]}}`))
	if a == c {
		t.Fatal("array order must count")
	}
	// Chosen fields: a volatile field does not count, a chosen one does.
	f1, _ := dedup.FingerprintJSON([]byte(`{"amount":100,"customer":{"id":"c1"},"sent_at":"10:00"}`), "amount", "customer.id")
	f2, _ := dedup.FingerprintJSON([]byte(`{"sent_at":"10:05","customer":{"id":"c1","name":"x"},"amount":100}`), "amount", "customer.id")
	f3, _ := dedup.FingerprintJSON([]byte(`{"amount":101,"customer":{"id":"c1"}}`), "amount", "customer.id")
	if f1 != f2 || f1 == f3 {
		t.Fatalf("field selection: %s %s %s", f1, f2, f3)
	}
	// Missing is not null.
	m1, _ := dedup.FingerprintJSON([]byte(`{"a":null}`), "a")
	m2, _ := dedup.FingerprintJSON([]byte(`{}`), "a")
	if m1 == m2 {
		t.Fatal("a missing field and a null field must differ")
	}
	// Big numbers keep their digits.
	n1, _ := dedup.FingerprintJSON([]byte(`{"n":12345678901234567890}`))
	n2, _ := dedup.FingerprintJSON([]byte(`{"n":12345678901234567891}`))
	if n1 == n2 {
		t.Fatal("large integers lost precision")
	}
	for _, bad := range []string{``, `{`, `{"a":1} {"b":2}`, `nul`} {
		if _, err := dedup.FingerprintJSON([]byte(bad)); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("FingerprintJSON(%q) error %v, want ErrInvalidArgument", bad, err)
		}
	}
}

// FuzzFingerprintJSON: never panics; a document and its canonical
// re-encoding through the same function agree.
func FuzzFingerprintJSON(f *testing.F) {
	for _, s := range []string{`{}`, `[]`, `{"a":[1,{"b":null}]}`, `"x"`, `1e400`, `{"a":1,"a":2}`} {
		f.Add([]byte(s), "a")
	}
	f.Fuzz(func(t *testing.T, doc []byte, field string) {
		fp, err := dedup.FingerprintJSON(doc)
		if err != nil {
			if !errors.Is(err, dedup.ErrInvalidArgument) {
				t.Fatalf("error %v is not an ArgumentError", err)
			}
			return
		}
		if fp2, err := dedup.FingerprintJSON(doc); err != nil || fp2 != fp {
			t.Fatalf("not stable: %s vs %s (%v)", fp, fp2, err)
		}
		if _, err := dedup.FingerprintJSON(doc, field); err != nil {
			t.Fatalf("valid document failed with a field: %v", err)
		}
	})
}
