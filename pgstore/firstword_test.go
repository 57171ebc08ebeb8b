package pgstore

import (
	"strings"
	"testing"
)

func TestIsDML(t *testing.T) {
	for sql, want := range map[string]bool{
		"INSERT INTO t VALUES (1)":                              true,
		"  update t set a = 1":                                  true,
		"\f\v\r\n\tdelete from t":                               true,
		"merge into t using s on true when matched then delete": true,
		"SELECT*FROM t":                                         true,
		"WITH x AS (DELETE FROM t RETURNING *) SELECT * FROM x": true,
		"values (1)":                                            true,
		"/* note */ DELETE FROM t":                              false, // nothing but blanks before the keyword
		"-- x\n DELETE FROM t":                                  false,
		"(select 1)":                                            false,
		"/* /* */ INSERT */ CALL p()":                           false, // nested comments: PostgreSQL reads CALL
		"-- x\rCALL p() /*\nINSERT */":                          false, // a -- comment ends at \r
		"/* /* */ SELECT */ ROLLBACK":                           false,
		"BEGIN":                                                 false,
		"commit":                                                false,
		"CALL p()":                                              false,
		"DO $$BEGIN COMMIT; END$$":                              false,
		"VACUUM t":                                              false,
		"SET statement_timeout = 0":                             false,
		"insertion":                                             false,
		"INSERT1 INTO t":                                        false,
		"INSERT$x":                                              false,
		"INSERT\u00e9 INTO t":                                   false,
		"E'x'":                                                  false,
		"":                                                      false,
	} {
		if got := isDML(sql); got != want {
			t.Errorf("isDML(%q) = %v, want %v", sql, got, want)
		}
	}
}

// FuzzFirstWord: firstWord never panics and returns a run of ASCII
// letters and underscores found in its input.
func FuzzFirstWord(f *testing.F) {
	for _, s := range []string{"BEGIN", "/* a */ -- b\n commit", "((;;select", "", "/*", "--", "é BEGIN", "INSERT1", " \fSELECT*"} {
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
