// Package testenv finds the real servers that integration tests talk to.
// Each engine's address comes from one environment variable with a
// loopback default. A server that does not answer skips the test with a
// message naming the variable, unless DEDUP_REQUIRE_SERVICES=1 (set by CI),
// which turns the skip into a failure.
package testenv

import (
	"net"
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
