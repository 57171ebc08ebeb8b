package pgstore

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/jackc/pgx/v5"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// A migration is one versioned SQL file of migrations/, named
// NNNN_name.sql.
type migration struct {
	version  int
	name     string
	sql      string // the template, with {{t:...}} and {{n:...}} placeholders
	checksum string // SHA-256 of the template
}

// migrations are the embedded migrations in version order. They are parsed
// once; a malformed file is a bug of this package and panics at start-up,
// in every test.
var migrations = func() []migration {
	entries, err := fs.ReadDir(migrationFS, "migrations")
	if err != nil {
		panic(err)
	}
	var out []migration
	for _, e := range entries {
		v, name, ok := strings.Cut(strings.TrimSuffix(e.Name(), ".sql"), "_")
		n, err := strconv.Atoi(v)
		if !ok || err != nil || n != len(out)+1 {
			panic("pgstore: migration file " + e.Name() + " is not named NNNN_name.sql in sequence")
		}
		b, err := migrationFS.ReadFile("migrations/" + e.Name())
		if err != nil {
			panic(err)
		}
		sum := sha256.Sum256(b)
		out = append(out, migration{version: n, name: name, sql: string(b), checksum: hex.EncodeToString(sum[:])})
	}
	return out
}()

// SchemaVersion is the schema version this package needs: the number of
// its last migration.
const SchemaVersion = 9

func init() {
	if len(migrations) != SchemaVersion {
		panic("pgstore: SchemaVersion is " + itoa(SchemaVersion) + " but " + itoa(len(migrations)) + " migrations are embedded")
	}
}

// names are the quoted, schema-qualified names of the store's tables.
type names struct {
	schema     string // quoted schema
	schemaName string // bare schema name
	prefix     string
	records    string // the plain records table (compact, migration 0006)
	recordsP   string // the partitioned parent (compact)
	scopes     string // scope -> integer
	legacy     string // the records table of migrations 0001-0005, until converted
	legacyP    string // its partitioned parent
	retention  string
	outbox     string
	migrations string
}

func newNames(schema, prefix string) names {
	t := func(n string) string { return pgx.Identifier{schema, prefix + n}.Sanitize() }
	return names{
		schema:     pgx.Identifier{schema}.Sanitize(),
		schemaName: schema,
		prefix:     prefix,
		records:    t("rec"),
		recordsP:   t("rec_p"),
		scopes:     t("scopes"),
		legacy:     t("records"),
		legacyP:    t("records_p"),
		retention:  t("retention"),
		outbox:     t("outbox"),
		migrations: t("schema_migrations"),
	}
}

// qualify returns the quoted, schema-qualified name of a table or index of
// the store named prefix + n.
func (n *names) qualify(name string) string {
	return pgx.Identifier{n.schemaName, n.prefix + name}.Sanitize()
}

var placeholder = regexp.MustCompile(`\{\{([tn]):([a-z_]+)\}\}`)

// render replaces {{t:name}} with the qualified table name and {{n:name}}
// with the bare quoted name (for indexes, which live in their table's
// schema).
func (n *names) render(tmpl string) string {
	return placeholder.ReplaceAllStringFunc(tmpl, func(m string) string {
		p := placeholder.FindStringSubmatch(m)
		if p[1] == "t" {
			return n.qualify(p[2])
		}
		return pgx.Identifier{n.prefix + p[2]}.Sanitize()
	})
}

// MigrateResult says what [Store.Migrate] did.
type MigrateResult struct {
	// Applied lists the migrations applied by this call, as "0001_records".
	Applied []string
	// Version is the schema version after the call.
	Version int
	// PartitionsCreated lists the partitions created, when the store uses
	// [WithPartitions].
	PartitionsCreated []string
}

// Migrate creates or upgrades the store's schema to [SchemaVersion]: the
// schema itself if missing, the records table and its expires_at index,
// the retention window table, the outbox table and the partitioned
// records table, each migration in its own transaction together with its
// row in <prefix>schema_migrations. It is idempotent: a migrated schema is
// left as it is. Concurrent calls (several instances starting at once) are
// serialised by a session advisory lock, and one applies what the other
// did not. With [WithPartitions] it then creates the partitions for the
// coming [WithPartitionsAhead].
//
// Migrate runs DDL on a connection of its own, never in a caller's
// transaction. It fails with a [*dedup.StoreError] if a migration that was
// applied earlier differs from the one embedded in this binary (someone
// edited it), rather than guess.
func (s *Store) Migrate(ctx context.Context) (MigrateResult, error) {
	return s.migrate(ctx, SchemaVersion)
}

// migrate is Migrate up to version upTo (tests build old schemas with it).
func (s *Store) migrate(ctx context.Context, upTo int) (MigrateResult, error) {
	var res MigrateResult
	if err := s.begin(ctx, "migrate"); err != nil {
		return res, err
	}
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return res, s.fail(ctx, "migrate", err, true)
	}
	defer conn.Release()
	lock := s.lockKey("migrate")
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, lock); err != nil {
		return res, s.fail(ctx, "migrate", err, true)
	}
	defer func() {
		// A fresh context: the caller's may be done. If the unlock fails
		// the connection is broken and the server drops the lock with it.
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, err := conn.Exec(uctx, `SELECT pg_advisory_unlock($1)`, lock); err != nil {
			conn.Conn().Close(uctx)
		}
	}()
	boot := `CREATE SCHEMA IF NOT EXISTS ` + s.names.schema + `;
CREATE TABLE IF NOT EXISTS ` + s.names.migrations + ` (
    version    integer PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT statement_timestamp()
)`
	if _, err := conn.Exec(ctx, boot); err != nil {
		return res, s.fail(ctx, "migrate", fmt.Errorf("create schema %s and its migrations table: %w", s.names.schema, err), false)
	}
	applied, err := appliedMigrations(ctx, conn.Conn(), s.names.migrations)
	if err != nil {
		return res, s.fail(ctx, "migrate", err, false)
	}
	for _, m := range migrations {
		if m.version > upTo {
			break
		}
		if sum, ok := applied[m.version]; ok {
			if sum != m.checksum {
				return res, s.fail(ctx, "migrate", fmt.Errorf("migration %04d_%s was applied with checksum %s but this binary has %s: the migration was edited after it was applied; restore it or fix the schema by hand", m.version, m.name, sum, m.checksum), true)
			}
			continue
		}
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, s.names.render(m.sql)); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+s.names.migrations+` (version, name, checksum) VALUES ($1, $2, $3)`, m.version, m.name, m.checksum)
			return err
		})
		if err != nil {
			return res, s.fail(ctx, "migrate", fmt.Errorf("apply %04d_%s: %w", m.version, m.name, err), false)
		}
		res.Applied = append(res.Applied, fmt.Sprintf("%04d_%s", m.version, m.name))
	}
	res.Version = upTo
	for v := range applied {
		res.Version = max(res.Version, v)
	}
	if s.cfg.partition > 0 && upTo == SchemaVersion {
		created, err := s.ensurePartitions(ctx, conn.Conn())
		res.PartitionsCreated = created
		if err != nil {
			return res, err
		}
	}
	return res, nil
}

// appliedMigrations returns the checksum of every applied version.
func appliedMigrations(ctx context.Context, conn *pgx.Conn, table string) (map[int]string, error) {
	rows, err := conn.Query(ctx, `SELECT version, checksum FROM `+table)
	if err != nil {
		return nil, err
	}
	out := map[int]string{}
	for rows.Next() {
		var v int
		var sum string
		if err := rows.Scan(&v, &sum); err != nil {
			rows.Close()
			return nil, err
		}
		out[v] = sum
	}
	return out, rows.Err()
}

// ErrNotMigrated matches the error of [Store.Check] when the schema is
// missing or older than [SchemaVersion].
var ErrNotMigrated = errors.New("pgstore: schema not migrated")

// Status is what [Store.Check] found.
type Status struct {
	// Version is the schema version in the database.
	Version int
	// Warnings lists every scope whose retention is shorter than its
	// replay horizon.
	Warnings []RetentionWarning
}

// Check is the start-up check: it verifies that the schema is at
// [SchemaVersion] or later and reads the retention windows, logging a
// warning and calling the hook of [WithRetentionWarningHook] for every
// scope whose retention is shorter than its declared replay horizon (a
// record would expire while the broker may still redeliver its message,
// and the redelivery would pass as new). Call it when the service starts,
// after Migrate if the service migrates itself.
//
// A missing or older schema gives an error matching [ErrNotMigrated] that
// says how to migrate. A schema newer than this package is logged, not an
// error: migrations only add.
func (s *Store) Check(ctx context.Context) (Status, error) {
	var st Status
	if err := s.begin(ctx, "check"); err != nil {
		return st, err
	}
	var reg *string
	if err := s.pool.QueryRow(ctx, `SELECT to_regclass($1)::text`, s.names.migrations).Scan(&reg); err != nil {
		return st, s.fail(ctx, "check", err, true)
	}
	if reg != nil {
		if err := s.pool.QueryRow(ctx, `SELECT COALESCE(max(version), 0) FROM `+s.names.migrations).Scan(&st.Version); err != nil {
			return st, s.fail(ctx, "check", err, true)
		}
	}
	if st.Version < SchemaVersion {
		return st, fmt.Errorf("%w: schema %s with table prefix %q is at version %d, this package needs %d; run `dedup migrate --schema %s --prefix %s` or call Store.Migrate",
			ErrNotMigrated, s.names.schemaName, s.names.prefix, st.Version, SchemaVersion, s.names.schemaName, s.names.prefix)
	}
	if st.Version > SchemaVersion {
		s.logger().WarnContext(ctx, "dedup schema is newer than this binary", "schema", s.names.schemaName, "prefix", s.names.prefix,
			"version", st.Version, "binary_version", SchemaVersion)
	}
	windows, err := s.RetentionWindows(ctx)
	if err != nil {
		return st, err
	}
	for _, w := range windows {
		if wn, ok := w.warning(); ok {
			st.Warnings = append(st.Warnings, wn)
			s.warnRetention(ctx, wn)
		}
	}
	sort.Slice(st.Warnings, func(i, j int) bool { return st.Warnings[i].Scope < st.Warnings[j].Scope })
	return st, nil
}

// argErr returns an argument error.
func argErr(arg, reason string) error { return &dedup.ArgumentError{Arg: arg, Reason: reason} }

func itoa(n int) string { return strconv.Itoa(n) }
