package scopelabel

import (
	"strconv"
	"sync"
	"testing"
)

func TestCapAndScoped(t *testing.T) {
	l := New(2, nil, nil)
	made := 0
	c := NewCache(func(p Pair) *string { made++; s := p.A + "|" + p.B; return &s })
	want := map[string]string{"a": "a", "b": "b", "c": Other, "other": Other, "a2": Other}
	for _, s := range []string{"a", "b", "c", "other", "a2", "a", "c"} {
		if got := *c.Scoped("st", s, l); got != "st|"+want[s] {
			t.Errorf("%s -> %s, want st|%s", s, got, want[s])
		}
	}
	if made != 3 {
		t.Errorf("%d entries made, want 3 (a, b, other)", made)
	}
}

func TestAllowlistAndRewrite(t *testing.T) {
	l := New(100, []string{"payments"}, func(s string) string {
		if i := len(s) - len("payments"); i > 0 && s[i:] == "payments" {
			return "payments"
		}
		return s
	})
	c := NewCache(func(p Pair) *string { s := p.B; return &s })
	// With a rewrite, a raw scope equal to a label must not be taken for
	// it without the rewrite running.
	c.Get(Pair{A: "st", B: "emails"})
	for raw, want := range map[string]string{"t1/payments": "payments", "emails": Other, "payments": "payments"} {
		if got := *c.Scoped("st", raw, l); got != want {
			t.Errorf("%s -> %s, want %s", raw, got, want)
		}
	}
}

func TestConcurrentAdmission(t *testing.T) {
	l := New(10, nil, nil)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 1000 {
				l.Label(strconv.Itoa((i*7 + g) % 50))
			}
		})
	}
	wg.Wait()
	if n := len(*l.seen.Load()); n != 10 {
		t.Errorf("%d scopes admitted, want 10", n)
	}
}
