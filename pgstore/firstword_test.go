package pgstore

import (
	"strings"
	"testing"
)

func TestControlsTx(t *testing.T) {
	for sql, want := range map[string]bool{
		"BEGIN":                                true,
		"  begin isolation level serializable": true,
		"/* note */ COMMIT":                    true,
		"-- x\n--y\n rollback":                 true,
		"(savepoint":                           true,
		";end":                                 true,
		"INSERT INTO t VALUES (1)":             false,
		"insert into begin_log values (1)":     false,
		"WITH x AS (SELECT 1) SELECT * FROM x": false,
		"beginning":                            false,
		"/* unterminated BEGIN":                false,
		"-- only a comment":                    false,
		"":                                     false,
	} {
		if got := controlsTx(sql); got != want {
			t.Errorf("controlsTx(%q) = %v, want %v", sql, got, want)
		}
	}
}

// FuzzFirstWord: firstWord never panics and returns a run of ASCII
// letters and underscores found in its input.
func FuzzFirstWord(f *testing.F) {
	for _, s := range []string{"BEGIN", "/* a */ -- b\n commit", "((;;select", "", "/*", "--", "é BEGIN"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, sql string) {
		w := firstWord(sql)
		if !strings.Contains(sql, w) {
			t.Fatalf("firstWord(%q) = %q, not in the input", sql, w)
		}
		for _, r := range w {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r == '_') {
				t.Fatalf("firstWord(%q) = %q: not a word", sql, w)
			}
		}
	})
}
