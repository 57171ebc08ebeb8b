package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// parseInterspersed parses args into fs as fs.Parse does, but accepts flags
// after positional arguments too: `dedup dlq inspect 42 --payload` and
// `dedup dlq inspect --payload 42` mean the same. A lone "--" ends the
// flags; everything after it is positional even if it starts with a dash.
// Afterwards fs.Args returns the positional arguments in their order.
//
// It stays on the standard library's flag package, re-run on what follows
// each positional argument, rather than moving to spf13/pflag or a larger
// framework: every subcommand already uses flag (its -h layout, its error
// texts rewritten by flagError, its one- and two-dash spellings), pflag
// would change what users type (single-dash long flags stop working) and
// add a dependency to a module whose root imports only the standard
// library, and the rule needed here fits in a loop.
func parseInterspersed(fs *flag.FlagSet, args []string) error {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		// fs.Parse stops at the first non-flag, or consumes a "--" and
		// stops after it: then the rest is positional as it stands.
		if used := len(args) - len(rest); used > 0 && args[used-1] == "--" {
			positional = append(positional, rest...)
			break
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
	// Leave the positional arguments where fs.Args finds them.
	return fs.Parse(append([]string{"--"}, positional...))
}

// Bounds of numeric flags: values past them are typing mistakes, not
// settings, and some would overflow or hang a command.
const (
	maxTimeout = 7 * 24 * time.Hour // --timeout of any command
	maxRate    = 1_000_000          // dlq replay --rate, records per second
	maxLimit   = 100_000_000        // dlq --limit
	maxBatch   = 1_000_000          // sweep --batch rows
	maxPause   = time.Hour          // sweep --pause
	maxLease   = 24 * time.Hour     // verify --lease
)

// checkTimeout refuses a --timeout that is not positive or past maxTimeout.
func checkTimeout(d time.Duration) error {
	if d <= 0 || d > maxTimeout {
		return badUsage("--timeout must be positive and at most %v, got %v", maxTimeout, d)
	}
	return nil
}

// explainPostgres turns a failure to reach PostgreSQL into a message that
// says whether a server answered and what it said, or what did not answer,
// and what to do next.
func explainPostgres(err error, conn string) error {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		where := "the PostgreSQL server"
		if cfg, perr := pgconn.ParseConfig(conn); perr == nil {
			where = fmt.Sprintf("the PostgreSQL server at %s:%d", cfg.Host, cfg.Port)
			switch pe.Code {
			case "3D000":
				return fmt.Errorf("%s answered: %s %s (SQLSTATE %s): it is running but has no database %q; create it (createdb -h %s -p %d -U %s %s) or name another database in --addr or DEDUP_POSTGRES_URL",
					where, pe.Severity, pe.Message, pe.Code, cfg.Database, cfg.Host, cfg.Port, cfg.User, cfg.Database)
			case "28000", "28P01":
				return fmt.Errorf("%s answered: %s %s (SQLSTATE %s): it is running but refused user %q; fix the user or password in --addr or DEDUP_POSTGRES_URL, or the server's pg_hba.conf",
					where, pe.Severity, pe.Message, pe.Code, cfg.User)
			}
		}
		return fmt.Errorf("%s answered: %s %s (SQLSTATE %s)", where, pe.Severity, pe.Message, pe.Code)
	}
	return fmt.Errorf("%w\nSet --addr or DEDUP_POSTGRES_URL to the database's connection string", err)
}

// explainSQLitePath says what is wrong with a SQLite --path that could not
// be opened, naming it.
func explainSQLitePath(err error, path string) error {
	dir := filepath.Dir(path)
	if st, serr := os.Stat(dir); serr != nil {
		return fmt.Errorf("open the SQLite database %s: its directory %s does not exist (create it, or choose another --path): %w", path, dir, err)
	} else if !st.IsDir() {
		return fmt.Errorf("open the SQLite database %s: %s is not a directory: %w", path, dir, err)
	}
	if st, serr := os.Stat(path); serr == nil && st.IsDir() {
		return fmt.Errorf("open the SQLite database %s: it is a directory; --path names a file: %w", path, err)
	}
	return fmt.Errorf("open the SQLite database %s: %w", path, err)
}
