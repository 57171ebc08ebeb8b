package pgstore

import (
	"strings"
	"testing"
)

func TestIsDML(t *testing.T) {
	for sql, want := range map[string]bool{
		"INSERT INTO t VALUES (1)": true,
		"  update t set a = 1":     true,
		"/* note */ DELETE FROM t": true,
		"-- x\n--y\n merge into t using s on true when matched then delete": true,
		"(select 1)": true,
		"WITH x AS (DELETE FROM t RETURNING *) SELECT * FROM x": true,
		"values (1)":                true,
		"BEGIN":                     false,
		"commit":                    false,
		"CALL p()":                  false,
		"DO $$BEGIN COMMIT; END$$":  false,
		"VACUUM t":                  false,
		"SET statement_timeout = 0": false,
		"insertion":                 false,
		"/* unterminated INSERT":    false,
		"-- only a comment":         false,
		"":                          false,
	} {
		if got := isDML(sql); got != want {
			t.Errorf("isDML(%q) = %v, want %v", sql, got, want)
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
