package dedup_test

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/dedupkit/dedup"
)

func TestNewKeyErrorsNameTheProblem(t *testing.T) {
	cases := []struct {
		scope, id, want string
	}{
		{"", "x", "key scope: is empty"},
		{"s", "", "key id: is empty"},
		{"s", strings.Repeat("x", dedup.MaxIDBytes+1), "over the limit of 512"},
		{strings.Repeat("x", dedup.MaxScopeBytes+1), "x", "key scope: is 257 bytes"},
		{"s", "a\xffb", "not valid UTF-8 at byte 1"},
		{"s", "ab\tc", "control character at byte 2"},
		{"s", "ab\u200bc\u009f", "control character at byte 6"},
	}
	for _, c := range cases {
		_, err := dedup.NewKey(c.scope, c.id)
		var ae *dedup.ArgumentError
		if !errors.Is(err, dedup.ErrInvalidArgument) || !errors.As(err, &ae) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("NewKey(%q, %q) = %v, want an ArgumentError containing %q", c.scope, c.id, err, c.want)
		}
	}
	if k, err := dedup.NewKey("payments/charge", "evt_01HZX"); err != nil || k.String() != "payments/charge/evt_01HZX" {
		t.Fatalf("valid key: %v, %v", k, err)
	}
}

func TestBusinessKey(t *testing.T) {
	a, err := dedup.BusinessKey("payments", "invoice", "inv-42", "capture")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := dedup.BusinessKey("payments", "invoice", "inv-42", "capture")
	if a != b {
		t.Fatalf("one intent gave two keys: %v, %v", a, b)
	}
	c, _ := dedup.BusinessKey("payments", "invoice", "inv-42", "refund")
	if a == c {
		t.Fatal("two intents collided")
	}
	// Field boundaries are kept: ("a/b","c") is not ("a","b/c").
	x, _ := dedup.BusinessKey("s", "a/b", "c")
	y, _ := dedup.BusinessKey("s", "a", "b/c")
	if x == y {
		t.Fatalf("field boundaries lost: %v", x)
	}
	if !strings.HasPrefix(a.ID, "bk:") {
		t.Fatalf("business key %q must not look like a transport id", a.ID)
	}
	long, err := dedup.BusinessKey("s", strings.Repeat("z", 2000))
	if err != nil || len(long.ID) > dedup.MaxIDBytes || !strings.HasPrefix(long.ID, "bk#sha256:") {
		t.Fatalf("long business key = %q, %v", long.ID, err)
	}
	for _, fields := range [][]string{nil, {""}, {"ok", "\xff"}} {
		if _, err := dedup.BusinessKey("s", fields...); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("BusinessKey(%q) error %v, want ErrInvalidArgument", fields, err)
		}
	}
}

// FuzzKeyValidate: Validate never panics, accepts exactly the keys that
// are non-empty, within limits, valid UTF-8 and free of control
// characters, and BusinessKey always yields a valid key or an error.
func FuzzKeyValidate(f *testing.F) {
	for _, s := range []string{"", "a", "msg-1", "a\x00", "\xff", "é", "\u0085", strings.Repeat("x", 513)} {
		f.Add("scope", s)
	}
	f.Fuzz(func(t *testing.T, scope, id string) {
		err := dedup.Key{Scope: scope, ID: id}.Validate()
		want := id != "" && scope != "" && len(id) <= dedup.MaxIDBytes && len(scope) <= dedup.MaxScopeBytes &&
			utf8.ValidString(id) && utf8.ValidString(scope) && !hasControl(id) && !hasControl(scope)
		if (err == nil) != want {
			t.Fatalf("Validate(%q, %q) = %v, want ok=%v", scope, id, err, want)
		}
		if k, err := dedup.BusinessKey(scope, id, "x"); err == nil {
			if k.Validate() != nil {
				t.Fatalf("BusinessKey returned an invalid key %v", k)
			}
		}
	})
}

func hasControl(s string) bool {
	for _, r := range s {
		if r < 0x20 || (r >= 0x7f && r < 0xa0) {
			return true
		}
	}
	return false
}
