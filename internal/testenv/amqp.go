package testenv

import (
	"net"
	"net/url"
	"os"
	"testing"
)

// DefaultAMQPURL is the RabbitMQ server tests use when DEDUP_AMQP_URL is
// not set.
const DefaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

// AMQPURL returns the URL in DEDUP_AMQP_URL (or [DefaultAMQPURL]) after
// checking that its server accepts TCP connections; like [Addrs], it skips
// the test or fails it when the server does not answer. A URL that does not
// parse fails the test: it is a mistake in the environment, not a missing
// server.
func AMQPURL(t testing.TB) string {
	t.Helper()
	v := os.Getenv("DEDUP_AMQP_URL")
	if v == "" {
		v = DefaultAMQPURL
	}
	addr, err := amqpAddr(v)
	if err != nil {
		t.Fatalf("DEDUP_AMQP_URL=%q: %v", v, err)
	}
	Addrs(t, "DEDUP_AMQP_URL", addr, "RabbitMQ")
	return v
}

// amqpAddr returns host:port of an amqp:// or amqps:// URL, with the
// scheme's default port when the URL names none.
func amqpAddr(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", err
	}
	port := ""
	switch u.Scheme {
	case "amqp":
		port = "5672"
	case "amqps":
		port = "5671"
	default:
		return "", &url.Error{Op: "parse", URL: raw, Err: errScheme}
	}
	host := u.Hostname()
	if host == "" {
		host = "localhost"
	}
	if p := u.Port(); p != "" {
		port = p
	}
	return net.JoinHostPort(host, port), nil
}

type schemeError struct{}

func (schemeError) Error() string { return "scheme must be amqp or amqps" }

var errScheme error = schemeError{}
