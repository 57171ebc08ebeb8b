// Package testenv finds the real servers that integration tests talk to.
// Each engine's address comes from one environment variable with a
// loopback default. A server that does not answer skips the test with a
// message naming the variable, unless DEDUP_REQUIRE_SERVICES=1 (set by CI),
// which turns the skip into a failure.
package testenv

import (
	"net"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"
)

// Required reports whether missing services fail tests instead of skipping.
func Required() bool { return os.Getenv("DEDUP_REQUIRE_SERVICES") == "1" }

// Addrs returns the comma-separated addresses in the environment variable
// env (or def), after checking that each accepts TCP connections.
func Addrs(t testing.TB, env, def, service string) []string {
	t.Helper()
	v := os.Getenv(env)
	if v == "" {
		v = def
	}
	addrs := strings.Split(v, ",")
	for _, a := range addrs {
		c, err := net.DialTimeout("tcp", a, 2*time.Second)
		if err != nil {
			msg := service + " is not reachable at " + a + " (" + err.Error() + "); set " + env + " to its address"
			if Required() {
				t.Fatal(msg + " (DEDUP_REQUIRE_SERVICES=1: a missing service is a failure)")
			}
			t.Skip(msg)
		}
		c.Close()
	}
	return addrs
}

// DefaultPostgresURL is the PostgreSQL connection string tests use when
// DEDUP_POSTGRES_URL is not set.
const DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// PostgresURL returns the connection string in DEDUP_POSTGRES_URL (or
// [DefaultPostgresURL]) after checking that its server accepts TCP
// connections; like [Addrs], it skips the test or fails it when the server
// does not answer. A URL or key=value string naming a Unix socket is
// returned unchecked.
func PostgresURL(t testing.TB) string {
	t.Helper()
	v := os.Getenv("DEDUP_POSTGRES_URL")
	if v == "" {
		v = DefaultPostgresURL
	}
	if addr := postgresAddr(v); addr != "" {
		Addrs(t, "DEDUP_POSTGRES_URL", addr, "PostgreSQL")
	}
	return v
}

// postgresAddr returns host:port of the first host in a PostgreSQL
// connection string, or "" for a Unix socket.
func postgresAddr(conn string) string {
	host, port := "", ""
	if u, err := url.Parse(conn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		hp, _, _ := strings.Cut(u.Host, ",")
		if h, p, err := net.SplitHostPort(hp); err == nil {
			host, port = h, p
		} else {
			host = hp
		}
	} else {
		for _, kv := range strings.Fields(conn) {
			k, v, _ := strings.Cut(kv, "=")
			switch k {
			case "host":
				host, _, _ = strings.Cut(v, ",")
			case "port":
				port, _, _ = strings.Cut(v, ",")
			}
		}
	}
	if host == "" {
		host = "localhost"
	}
	if strings.HasPrefix(host, "/") || strings.HasPrefix(host, "%2F") {
		return ""
	}
	if port == "" {
		port = "5432"
	}
	return net.JoinHostPort(strings.Trim(host, "[]"), port)
}

// FreePort returns a loopback TCP port that was free a moment ago.
func FreePort(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	_, port, _ := net.SplitHostPort(l.Addr().String())
	return port
}

// DefaultNATSURL is the NATS server tests use when DEDUP_NATS_URL is not
// set.
const DefaultNATSURL = "nats://127.0.0.1:4222"

// NATSURL returns the URL in DEDUP_NATS_URL (or [DefaultNATSURL]) after
// checking that its server accepts TCP connections; like [Addrs], it skips
// the test or fails it when the server does not answer.
func NATSURL(t testing.TB) string {
	t.Helper()
	v := os.Getenv("DEDUP_NATS_URL")
	if v == "" {
		v = DefaultNATSURL
	}
	first, _, _ := strings.Cut(v, ",")
	if u, err := url.Parse(first); err == nil && u.Host != "" {
		Addrs(t, "DEDUP_NATS_URL", u.Host, "NATS (with JetStream)")
	}
	return v
}
