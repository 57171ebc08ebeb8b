package testenv

import (
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// RedisServer is a private redis-server on a free loopback port, so that a
// test can flush, stop or freeze it without disturbing the others. It is
// killed when the test ends.
type RedisServer struct {
	t    testing.TB
	Port string
	cmd  *exec.Cmd
}

// StartRedis starts a redis-server without persistence on port, or on a
// free port when port is empty. A machine without redis-server skips the
// test (fails it under DEDUP_REQUIRE_SERVICES=1).
func StartRedis(t testing.TB, port string) *RedisServer {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		msg := "redis-server is not installed (apt-get install redis-server)"
		if Required() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	if port == "" {
		port = FreePort(t)
	}
	cmd := exec.Command("redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting redis-server: %v", err)
	}
	s := &RedisServer{t: t, Port: port, cmd: cmd}
	t.Cleanup(s.Stop)
	for range 100 {
		if out, err := exec.Command("redis-cli", "-p", port, "ping").Output(); err == nil && strings.TrimSpace(string(out)) == "PONG" {
			return s
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("redis-server on port %s did not answer", port)
	return nil
}

// Addrs returns the server's address as a rueidis InitAddress.
func (s *RedisServer) Addrs() []string { return []string{"127.0.0.1:" + s.Port} }

// Stop kills the server (a crash: nothing is saved).
func (s *RedisServer) Stop() {
	if s.cmd.ProcessState == nil {
		s.cmd.Process.Signal(syscall.SIGCONT)
		s.cmd.Process.Kill()
		s.cmd.Wait()
	}
}

// Freeze stops the server process without closing its sockets, so calls
// time out; Thaw resumes it.
func (s *RedisServer) Freeze() { s.cmd.Process.Signal(syscall.SIGSTOP) }

// Thaw resumes a frozen server.
func (s *RedisServer) Thaw() { s.cmd.Process.Signal(syscall.SIGCONT) }

// CLI runs redis-cli against the server and returns its output.
func (s *RedisServer) CLI(args ...string) string {
	s.t.Helper()
	out, err := exec.Command("redis-cli", append([]string{"-p", s.Port}, args...)...).CombinedOutput()
	if err != nil {
		s.t.Fatalf("redis-cli %v: %v %s", args, err, out)
	}
	return strings.TrimSpace(string(out))
}
