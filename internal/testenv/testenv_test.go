package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// deadAddr returns a loopback host:port where nothing listens.
func deadAddr(t *testing.T) string {
	t.Helper()
	return "127.0.0.1:" + FreePort(t)
}

func TestPostgresAddrs(t *testing.T) {
	t.Setenv("PGHOST", "")
	t.Setenv("PGPORT", "")
	for _, tc := range []struct {
		conn string
		want []string
	}{
		{"postgres://postgres@127.0.0.1:5432/test?sslmode=disable", []string{"127.0.0.1:5432"}},
		{"postgresql://u:secret@db.example:6543/x?sslmode=disable&application_name=t", []string{"db.example:6543"}},
		{"postgres://u@[::1]:5433/x?sslmode=disable", []string{"[::1]:5433"}},
		{"postgres://u@h1:5001,h2:5002/x?sslmode=disable", []string{"h1:5001", "h2:5002"}},
		{"postgres://u@127.0.0.1/x?sslmode=disable&pool_max_conns=4", []string{"127.0.0.1:5432"}},
		{"host=127.0.0.1 port=5433 user=postgres dbname=test sslmode=disable", []string{"127.0.0.1:5433"}},
		{"host=10.0.0.1,10.0.0.2 port=5001,5002 dbname=test sslmode=disable", []string{"10.0.0.1:5001", "10.0.0.2:5002"}},
		{"host='127.0.0.1' port = 5434 dbname=test sslmode=disable", []string{"127.0.0.1:5434"}},
		{"host=/var/run/postgresql dbname=test", nil},
		{"postgres:///test?host=/tmp", nil},
	} {
		got, err := postgresAddrs(tc.conn)
		if err != nil {
			t.Errorf("postgresAddrs(%q): %v", tc.conn, err)
			continue
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("postgresAddrs(%q) = %q, want %q", tc.conn, got, tc.want)
		}
	}
	for _, bad := range []string{"postgres://u:secret@h:notaport/x", "host=h port=x", "mysql://h:3306/x"} {
		_, err := postgresAddrs(bad)
		if err == nil {
			t.Errorf("postgresAddrs(%q): no error", bad)
		} else if strings.Contains(err.Error(), "secret") {
			t.Errorf("postgresAddrs(%q): the error shows the password: %v", bad, err)
		}
	}
}

func TestNATSAddrs(t *testing.T) {
	for _, tc := range []struct {
		list string
		want []string
	}{
		{"nats://127.0.0.1:4222", []string{"127.0.0.1:4222"}},
		{"127.0.0.1:4223", []string{"127.0.0.1:4223"}},
		{"localhost", []string{"localhost:4222"}},
		{"nats://a:1, nats://b:2 ,tls://c", []string{"a:1", "b:2", "c:4222"}},
		{"nats://user:pw@127.0.0.1:4222", []string{"127.0.0.1:4222"}},
		{"ws://h", []string{"h:80"}},
		{"wss://h", []string{"h:443"}},
		{"nats://[::1]:4222", []string{"[::1]:4222"}},
	} {
		got, err := natsAddrs(tc.list)
		if err != nil {
			t.Errorf("natsAddrs(%q): %v", tc.list, err)
			continue
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("natsAddrs(%q) = %q, want %q", tc.list, got, tc.want)
		}
	}
	for _, bad := range []string{"", " , ", "http://h:4222", "nats://", "nats://h:4222/%zz"} {
		if got, err := natsAddrs(bad); err == nil {
			t.Errorf("natsAddrs(%q) = %q, want an error", bad, got)
		}
	}
}

func TestSplitHostPorts(t *testing.T) {
	got, err := splitHostPorts("127.0.0.1:7000, 127.0.0.1:7001,[::1]:7002")
	if want := []string{"127.0.0.1:7000", "127.0.0.1:7001", "[::1]:7002"}; err != nil || !slices.Equal(got, want) {
		t.Errorf("splitHostPorts = %q, %v; want %q", got, err, want)
	}
	for _, bad := range []string{"", "127.0.0.1", "redis://127.0.0.1:6379", "a:1,,b:2", ":6379", "h:"} {
		if got, err := splitHostPorts(bad); err == nil {
			t.Errorf("splitHostPorts(%q) = %q, want an error", bad, got)
		}
	}
}

func TestRedact(t *testing.T) {
	for _, tc := range []struct {
		in     string
		redact func(string) string
		keep   string
	}{
		{"postgres://u:secret@h:5432/x", redactPostgres, "postgres://u:xxxxx@h:5432/x"},
		{"postgres://u@h:5432/x?password=secret&sslmode=disable", redactPostgres, "password=xxxxx"},
		{"host=h password=secret dbname=x", redactPostgres, "host=h password=xxxxx dbname=x"},
		{"host=h password='se cret' dbname=x", redactPostgres, "host=h password=xxxxx dbname=x"},
		{"nats://u:secret@h:4222,nats://h2", redactNATS, "nats://u:xxxxx@h:4222,nats://h2"},
		{"secret@h:4222", redactNATS, "xxxxx@h:4222"},
	} {
		got := tc.redact(tc.in)
		if strings.Contains(got, "secret") || strings.Contains(got, "se cret") || !strings.Contains(got, tc.keep) {
			t.Errorf("redact(%q) = %q, want it to contain %q and no password", tc.in, got, tc.keep)
		}
	}
}

// TestProbe: one answering address of a failover list is enough, every
// address of a cluster must answer, and the error names each address that
// did not answer.
func TestProbe(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	live, dead := l.Addr().String(), deadAddr(t)
	if err := probe([]string{dead, live}, false); err != nil {
		t.Errorf("any of dead, live: %v", err)
	}
	err = probe([]string{live, dead}, true)
	if !errors.Is(err, errUnreachable) || !strings.Contains(err.Error(), dead) || strings.Contains(err.Error(), live) {
		t.Errorf("all of live, dead: %v; want errUnreachable naming %s only", err, dead)
	}
	if err := probe([]string{live}, true); err != nil {
		t.Errorf("all of live: %v", err)
	}
}

// TestUnreachableMessage: the skip or failure names the variable, the value
// it held (password hidden) and the address probed.
func TestUnreachableMessage(t *testing.T) {
	dead := deadAddr(t)
	host, port, _ := net.SplitHostPort(dead)
	t.Setenv("DEDUP_POSTGRES_URL", fmt.Sprintf("host=%s port=%s user=postgres password=secret dbname=test", host, port))
	s := lookup("DEDUP_POSTGRES_URL", DefaultPostgresURL, "PostgreSQL")
	addrs, err := postgresAddrs(s.value)
	if err != nil {
		t.Fatal(err)
	}
	msg := unreachable(s, addrs, probe(addrs, false), redactPostgres)
	for _, want := range []string{"PostgreSQL", "DEDUP_POSTGRES_URL=host=" + host + " port=" + port, "password=xxxxx", "probed " + dead, "connection refused"} {
		if !strings.Contains(msg, want) {
			t.Errorf("message %q lacks %q", msg, want)
		}
	}
	if strings.Contains(msg, "secret") {
		t.Errorf("message %q shows the password", msg)
	}

	t.Setenv("DEDUP_NATS_URL", "")
	s = lookup("DEDUP_NATS_URL", DefaultNATSURL, "NATS")
	if msg := unreachable(s, []string{dead}, errUnreachable, nil); !strings.Contains(msg, "DEDUP_NATS_URL is unset; the default is "+DefaultNATSURL) {
		t.Errorf("message %q does not say the variable is unset and which default was used", msg)
	}
}

// postgresForms returns the server PostgresURL finds, written in other
// forms than the one configured: key=value pairs, a postgresql:// URL with
// explicit parameters, and a host list whose first host is dead.
func postgresForms(t *testing.T) map[string]string {
	t.Helper()
	conn := PostgresURL(t)
	cfg, err := pgx.ParseConfig(conn)
	if err != nil {
		t.Fatal(err)
	}
	if strings.HasPrefix(cfg.Host, "/") {
		t.Skipf("DEDUP_POSTGRES_URL names a Unix socket (%s): the forms below are TCP", cfg.Host)
	}
	pw := ""
	if cfg.Password != "" {
		pw = " password='" + strings.ReplaceAll(cfg.Password, "'", `\'`) + "'"
	}
	dead := deadAddr(t)
	_, deadPort, _ := net.SplitHostPort(dead)
	hostport := net.JoinHostPort(cfg.Host, fmt.Sprint(cfg.Port))
	return map[string]string{
		"key=value": fmt.Sprintf("host=%s port=%d user=%s%s dbname=%s sslmode=disable", cfg.Host, cfg.Port, cfg.User, pw, cfg.Database),
		"postgresql-url": fmt.Sprintf("postgresql://%s@%s/%s?sslmode=disable&connect_timeout=5&application_name=dedup-testenv&pool_max_conns=2",
			cfg.User, hostport, cfg.Database),
		"dead-host-first": fmt.Sprintf("host=127.0.0.1,%s port=%s,%d user=%s%s dbname=%s sslmode=disable",
			cfg.Host, deadPort, cfg.Port, cfg.User, pw, cfg.Database),
	}
}

// TestPostgresURLForms proves that tests run, not skip, when
// DEDUP_POSTGRES_URL holds another form of the address: each form passes
// the probe and reaches the same database.
func TestPostgresURLForms(t *testing.T) {
	forms := postgresForms(t)
	if _, ok := forms["postgresql-url"]; ok {
		// The password, if any, goes through PGPASSWORD for the URL form.
		cfg, _ := pgx.ParseConfig(PostgresURL(t))
		if cfg.Password != "" {
			t.Setenv("PGPASSWORD", cfg.Password)
		}
	}
	for name, conn := range forms {
		t.Run(name, func(t *testing.T) {
			t.Setenv("DEDUP_POSTGRES_URL", conn)
			got := PostgresURL(t) // skips or fails here if the form were misread
			if got != conn {
				t.Fatalf("PostgresURL = %q, want the variable's value %q", got, conn)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			cfg, err := pgx.ParseConfig(strings.Replace(got, "&pool_max_conns=2", "", 1))
			if err != nil {
				t.Fatal(err)
			}
			c, err := pgx.ConnectConfig(ctx, cfg)
			if err != nil {
				t.Fatalf("connect with %s: %v", redactPostgres(got), err)
			}
			defer c.Close(context.Background())
			var one int
			if err := c.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
				t.Fatalf("SELECT 1 = %d, %v", one, err)
			}
		})
	}
}

// TestNATSURLForms proves the same for DEDUP_NATS_URL: a bare host:port, a
// nats:// URL on the host's name, and a list whose first server is dead
// all pass the probe and reach JetStream.
func TestNATSURLForms(t *testing.T) {
	base := NATSURL(t)
	addrs, err := natsAddrs(base)
	if err != nil {
		t.Fatal(err)
	}
	// The first server that answers is the one the forms are built on.
	var hostport string
	for _, a := range addrs {
		if probe([]string{a}, true) == nil {
			hostport = a
			break
		}
	}
	host, port, _ := net.SplitHostPort(hostport)
	named := hostport
	if host == "127.0.0.1" {
		named = net.JoinHostPort("localhost", port)
	}
	for name, list := range map[string]string{
		"host:port":       hostport,
		"nats-url-byname": "nats://" + named,
		"dead-first":      "nats://" + deadAddr(t) + ", nats://" + hostport,
	} {
		t.Run(name, func(t *testing.T) {
			t.Setenv("DEDUP_NATS_URL", list)
			got := NATSURL(t)
			if got != list {
				t.Fatalf("NATSURL = %q, want the variable's value %q", got, list)
			}
			nc, err := nats.Connect(got, nats.Timeout(3*time.Second), nats.DontRandomize())
			if err != nil {
				t.Fatalf("connect to %s: %v", got, err)
			}
			defer nc.Close()
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if _, err := js.AccountInfo(ctx); err != nil {
				t.Fatalf("JetStream on %s: %v", got, err)
			}
		})
	}
}

// TestAddrsReadsHostPorts: DEDUP_REDIS_ADDR with blanks around a list's
// entries is read as the list, and the addresses come back normalised.
func TestAddrsReadsHostPorts(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	t.Setenv("DEDUP_TESTENV_PROBE", " "+l.Addr().String()+" , "+l.Addr().String())
	got := Addrs(t, "DEDUP_TESTENV_PROBE", "127.0.0.1:1", "probe")
	if want := []string{l.Addr().String(), l.Addr().String()}; !slices.Equal(got, want) {
		t.Errorf("Addrs = %q, want %q", got, want)
	}
}
