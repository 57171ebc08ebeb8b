package testenv

import (
	"fmt"
	"net"
	"net/url"
	"strings"
	"testing"
)

// DefaultNATSURL is the NATS server tests use when DEDUP_NATS_URL is not
// set.
const DefaultNATSURL = "nats://127.0.0.1:4222"

// NATSURL returns the server list in DEDUP_NATS_URL (or [DefaultNATSURL])
// after checking that one of its servers accepts TCP connections, as the
// NATS client connects to any one of the list. Each comma-separated entry
// is read as nats.go reads it: a nats://, tls://, ws:// or wss:// URL, or
// a bare host:port (meaning nats://), the port defaulting to 4222 (80 and
// 443 for ws and wss). A server that does not answer skips the test (fails
// it under DEDUP_REQUIRE_SERVICES=1), naming the variable and its value
// with any password hidden.
func NATSURL(t testing.TB) string {
	t.Helper()
	s := lookup("DEDUP_NATS_URL", DefaultNATSURL, "NATS (with JetStream)")
	addrs, err := natsAddrs(s.value)
	if err != nil {
		invalid(t, s, redactNATS, err)
	}
	check(t, s, addrs, false, redactNATS)
	return s.value
}

// natsAddrs returns the host:port of each server in a NATS URL list.
func natsAddrs(list string) ([]string, error) {
	var addrs []string
	for _, entry := range strings.Split(list, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		raw := entry
		if !strings.Contains(raw, "://") {
			raw = "nats://" + raw
		}
		u, err := url.Parse(raw)
		if err != nil {
			return nil, fmt.Errorf("%q is not a NATS URL: %v", redactNATS(entry), err)
		}
		port := "4222"
		switch u.Scheme {
		case "nats", "tls":
		case "ws":
			port = "80"
		case "wss":
			port = "443"
		default:
			return nil, fmt.Errorf("%q: scheme %q is not one NATS serves (nats, tls, ws, wss)", redactNATS(entry), u.Scheme)
		}
		if u.Hostname() == "" {
			return nil, fmt.Errorf("%q names no host", redactNATS(entry))
		}
		if p := u.Port(); p != "" {
			port = p
		}
		addrs = append(addrs, net.JoinHostPort(u.Hostname(), port))
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("no server URL in %q", list)
	}
	return addrs, nil
}

// redactNATS hides passwords and tokens in a NATS URL list.
func redactNATS(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		raw := strings.TrimSpace(p)
		if !strings.Contains(raw, "@") {
			continue
		}
		scheme := ""
		if !strings.Contains(raw, "://") {
			scheme = "nats://"
		}
		u, err := url.Parse(scheme + raw)
		if err != nil || u.User == nil {
			parts[i] = "xxxxx@" + raw[strings.LastIndex(raw, "@")+1:]
			continue
		}
		if _, has := u.User.Password(); !has {
			// A lone user part is a token.
			u.User = url.User("xxxxx")
		}
		parts[i] = strings.TrimPrefix(u.Redacted(), scheme)
	}
	return strings.Join(parts, ",")
}
