// Package testenv finds the real servers that integration tests talk to.
// Each engine's address comes from one environment variable with a
// loopback default:
//
//	DEDUP_POSTGRES_URL         a PostgreSQL connection string, URL or key=value form
//	DEDUP_NATS_URL             a NATS server URL, or a comma-separated list of them
//	DEDUP_REDIS_ADDR           Redis host:port, comma-separated for several
//	DEDUP_REDIS_CLUSTER_ADDRS  the host:port of Redis Cluster nodes, comma-separated
//
// The variable is read once per lookup and parsed as the kind of address it
// documents; reachability is probed on the host and port the parse yields.
// A server that does not answer skips the test with a message naming the
// variable and the value it held, unless DEDUP_REQUIRE_SERVICES=1 (set by
// CI), which turns the skip into a failure. A value that does not parse is
// always a failure: it is a mistake to fix, not a missing server.
package testenv

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"
)

// Required reports whether missing services fail tests instead of skipping.
func Required() bool { return os.Getenv("DEDUP_REQUIRE_SERVICES") == "1" }

// dialTimeout bounds each reachability probe.
const dialTimeout = 2 * time.Second

// setting is one engine's variable as read from the environment.
type setting struct {
	env     string // the variable's name
	value   string // what it held, or the default when unset
	def     bool   // the variable was unset or empty
	service string // what the tests look for there, for messages
}

// lookup reads env once.
func lookup(env, def, service string) setting {
	if v := os.Getenv(env); v != "" {
		return setting{env: env, value: v, service: service}
	}
	return setting{env: env, value: def, def: true, service: service}
}

// describe names the variable and the value it held, with any password
// hidden by redact.
func (s setting) describe(redact func(string) string) string {
	v := s.value
	if redact != nil {
		v = redact(v)
	}
	if s.def {
		return fmt.Sprintf("%s is unset; the default is %s", s.env, v)
	}
	return fmt.Sprintf("%s=%s", s.env, v)
}

// errUnreachable marks a probe where no address answered.
var errUnreachable = errors.New("not reachable")

// probe dials each address. With all true every address must answer (the
// nodes of a cluster, the hosts a test talks to one by one); otherwise one
// answering is enough (a client that fails over along a list). The error
// names every address that did not answer and why, and wraps
// errUnreachable.
func probe(addrs []string, all bool) error {
	var failed []string
	for _, a := range addrs {
		c, err := net.DialTimeout("tcp", a, dialTimeout)
		if err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", a, err))
			if all {
				break
			}
			continue
		}
		c.Close()
		if !all {
			return nil
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s", errUnreachable, strings.Join(failed, "; "))
}

// check probes addrs, parsed from s, and skips or fails t when they do not
// answer; the message names the variable and its value.
func check(t testing.TB, s setting, addrs []string, all bool, redact func(string) string) {
	t.Helper()
	err := probe(addrs, all)
	if err == nil {
		return
	}
	msg := unreachable(s, addrs, err, redact)
	if Required() {
		t.Fatal(msg + " (DEDUP_REQUIRE_SERVICES=1: a missing service is a failure)")
	}
	t.Skip(msg)
}

// unreachable is the message for a server that did not answer.
func unreachable(s setting, addrs []string, err error, redact func(string) string) string {
	return fmt.Sprintf("%s is not reachable (%s; probed %s): %v; start it or set %s to its address",
		s.service, s.describe(redact), strings.Join(addrs, ","), err, s.env)
}

// invalid fails t: the variable holds something that is not the kind of
// address it documents.
func invalid(t testing.TB, s setting, redact func(string) string, err error) {
	t.Helper()
	t.Fatalf("%s: %v", s.describe(redact), err)
}

// splitHostPorts parses a comma-separated list of host:port addresses, as
// DEDUP_REDIS_ADDR holds. Blanks around entries are ignored; an empty
// entry, a URL or an address without a port is an error.
func splitHostPorts(v string) ([]string, error) {
	var addrs []string
	for _, a := range strings.Split(v, ",") {
		a = strings.TrimSpace(a)
		if a == "" {
			return nil, fmt.Errorf("empty address in the list %q", v)
		}
		if strings.Contains(a, "://") {
			return nil, fmt.Errorf("%q is a URL; want host:port (for example 127.0.0.1:6379)", a)
		}
		host, port, err := net.SplitHostPort(a)
		if err != nil {
			return nil, fmt.Errorf("%q is not host:port: %v", a, err)
		}
		if host == "" || port == "" {
			return nil, fmt.Errorf("%q is not host:port: the host and the port are both needed", a)
		}
		addrs = append(addrs, net.JoinHostPort(host, port))
	}
	return addrs, nil
}

// Addrs returns the comma-separated host:port addresses in the environment
// variable env (or def when it is unset), after checking that each accepts
// TCP connections. It is the reading of DEDUP_REDIS_ADDR and
// DEDUP_REDIS_CLUSTER_ADDRS; service names the server in messages.
func Addrs(t testing.TB, env, def, service string) []string {
	t.Helper()
	s := lookup(env, def, service)
	addrs, err := splitHostPorts(s.value)
	if err != nil {
		invalid(t, s, nil, err)
	}
	check(t, s, addrs, true, nil)
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
