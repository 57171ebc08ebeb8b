package testenv

import (
	"context"
	"fmt"
	"math/rand/v2"
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
		t.Fatalf("connect to %s: %v", url, pgPoolErr)
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
