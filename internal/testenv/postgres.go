package testenv

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

var (
	pgPoolOnce sync.Once
	pgPool     *pgxpool.Pool
	pgPoolErr  error
)

// PostgresPool returns a pool on PostgresURL shared by the whole test
// binary (at most 24 connections unless the URL sets pool_max_conns),
// skipping the test when the server does not answer (failing it under
// DEDUP_REQUIRE_SERVICES=1).
func PostgresPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	url := PostgresURL(t)
	pgPoolOnce.Do(func() {
		cfg, err := pgxpool.ParseConfig(url)
		if err != nil {
			pgPoolErr = err
			return
		}
		if !strings.Contains(url, "pool_max_conns") {
			cfg.MaxConns = 24
		}
		pgPool, pgPoolErr = pgxpool.NewWithConfig(context.Background(), cfg)
	})
	if pgPoolErr != nil {
		t.Fatalf("connect to %s: %v", redactPostgres(url), pgPoolErr)
	}
	return pgPool
}

// PostgresSchema returns the name of a schema of the test's own (not yet
// created), dropped with everything in it when the test ends. Tests run in
// parallel with other packages' tests on the same server; schemas keep
// them apart.
func PostgresSchema(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	name := strings.Map(func(r rune) rune {
		switch {
		case 'a' <= r && r <= 'z', '0' <= r && r <= '9':
			return r
		case 'A' <= r && r <= 'Z':
			return r + 'a' - 'A'
		}
		return '_'
	}, t.Name())
	if len(name) > 30 {
		name = name[:30]
	}
	name = fmt.Sprintf("dedup_t_%s_%08x", name, rand.Uint32())
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{name}.Sanitize()+` CASCADE`); err != nil {
			t.Errorf("drop schema %s: %v", name, err)
		}
	})
	return name
}

// DefaultPostgresURL is the PostgreSQL connection string tests use when
// DEDUP_POSTGRES_URL is not set.
const DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// PostgresURL returns the connection string in DEDUP_POSTGRES_URL (or
// [DefaultPostgresURL]) after checking that its server accepts TCP
// connections. The string may take any form pgx accepts: a postgres:// or
// postgresql:// URL, or key=value pairs (host=... port=... dbname=...),
// with several hosts or pool_ settings. It is parsed as pgx parses it and
// the host and port that yields are probed; one answering host of several
// is enough, as pgx tries them in turn. A connection string naming only
// Unix sockets is returned unprobed. A server that does not answer skips
// the test (fails it under DEDUP_REQUIRE_SERVICES=1), naming the variable
// and its value with any password hidden.
func PostgresURL(t testing.TB) string {
	t.Helper()
	s := lookup("DEDUP_POSTGRES_URL", DefaultPostgresURL, "PostgreSQL")
	addrs, err := postgresAddrs(s.value)
	if err != nil {
		invalid(t, s, redactPostgres, err)
	}
	if len(addrs) > 0 {
		check(t, s, addrs, false, redactPostgres)
	}
	return s.value
}

// postgresAddrs returns the host:port of every TCP host a connection
// string names, in the order pgx tries them, leaving out Unix sockets.
func postgresAddrs(conn string) ([]string, error) {
	cfg, err := pgxpool.ParseConfig(conn)
	if err != nil {
		// pgconn hides the password in its message.
		return nil, fmt.Errorf("not a PostgreSQL connection string: %v", err)
	}
	cc := cfg.ConnConfig
	var addrs []string
	add := func(host string, port uint16) {
		if strings.HasPrefix(host, "/") {
			return
		}
		a := net.JoinHostPort(host, strconv.Itoa(int(port)))
		for _, b := range addrs {
			if a == b {
				return
			}
		}
		addrs = append(addrs, a)
	}
	add(cc.Host, cc.Port)
	for _, f := range cc.Fallbacks {
		add(f.Host, f.Port)
	}
	return addrs, nil
}

var passwordPair = regexp.MustCompile(`(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// redactPostgres hides the password in a connection string of either form.
func redactPostgres(conn string) string {
	if u, err := url.Parse(conn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		if q.Has("password") {
			q.Set("password", "xxxxx")
			u.RawQuery = q.Encode()
		}
		return u.Redacted()
	}
	return passwordPair.ReplaceAllString(conn, "${1}xxxxx")
}
