package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dedupkit/dedup/internal/verify"
)

// childEnv, when set, makes the test binary run `dedup` with the JSON
// argument list it holds instead of the tests, so a test can run the proxy
// as a real process and send it real signals.
const childEnv = "DEDUPTEST_CHILD_ARGS"

func TestMain(m *testing.M) {
	// A worker process of `dedup verify --processes` (this binary re-run).
	if code, ok := verify.WorkerMain(os.Stdin, os.Stdout, os.Stderr); ok {
		os.Exit(code)
	}
	if a := os.Getenv(childEnv); a != "" {
		var args []string
		if err := json.Unmarshal([]byte(a), &args); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(3)
		}
		os.Exit(run(args, os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// proxyProcess is `dedup proxy` running as a child process.
type proxyProcess struct {
	cmd    *exec.Cmd
	base   string
	stderr *syncBuffer
	exited chan int
}

var listeningRE = regexp.MustCompile(`msg="dedup proxy listening" addr=(\S+)`)

// startProxyProcess runs `dedup proxy args...` as a child process on a
// free port and waits until it listens.
func startProxyProcess(t *testing.T, args ...string) *proxyProcess {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	a, _ := json.Marshal(append([]string{"proxy", "--listen", "127.0.0.1:0"}, args...))
	p := &proxyProcess{cmd: exec.Command(exe), stderr: &syncBuffer{}, exited: make(chan int, 1)}
	p.cmd.Env = append(os.Environ(), childEnv+"="+string(a))
	pipe, err := p.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pipe)
		sent := false
		for sc.Scan() {
			line := sc.Text()
			p.stderr.Write([]byte(line + "\n"))
			if m := listeningRE.FindStringSubmatch(line); m != nil && !sent {
				addr <- m[1]
				sent = true
			}
		}
		p.cmd.Wait()
		p.exited <- p.cmd.ProcessState.ExitCode()
	}()
	t.Cleanup(func() {
		p.cmd.Process.Kill()
	})
	select {
	case a := <-addr:
		p.base = "http://" + a
	case code := <-p.exited:
		t.Fatalf("the proxy exited %d: %s", code, p.stderr.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("the proxy did not start: %s", p.stderr.String())
	}
	return p
}

func (p *proxyProcess) waitLog(t *testing.T, s string) {
	t.Helper()
	for range 3000 {
		if strings.Contains(p.stderr.String(), s) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("the proxy never logged %q: %s", s, p.stderr.String())
}

func (p *proxyProcess) wait(t *testing.T) int {
	t.Helper()
	select {
	case code := <-p.exited:
		return code
	case <-time.After(60 * time.Second):
		t.Fatalf("the proxy did not exit: %s", p.stderr.String())
		return -1
	}
}

// TestProxySIGTERMMidCall: SIGTERM while a call runs waits for it (the
// default --shutdown-timeout outlasts --upstream-timeout) and stores its
// response; with a shutdown timeout shorter than the call, the call is
// abandoned but its key is never released, so a restarted proxy answers
// the retry 409 instead of running it again.
func TestProxySIGTERMMidCall(t *testing.T) {
	t.Run("waits", func(t *testing.T) {
		up := newGatedUpstream(t, false)
		db := filepath.Join(t.TempDir(), "keys.db")
		args := []string{"--upstream", up.srv.URL, "--single-tenant", "--store", "sqlite", "--path", db, "--upstream-timeout", "20s", "--lease", "30s"}
		p := startProxyProcess(t, args...)
		got := make(chan reply, 1)
		go func() { got <- send(t, "POST", p.base+"/pay", "sigterm", "x") }()
		up.waitStarted(t)
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		p.waitLog(t, "shutting down")
		up.open()
		r := <-got
		if r.status != http.StatusCreated || r.body != "done run 1\n" {
			t.Fatalf("the call in flight at SIGTERM: %d %q", r.status, r.body)
		}
		if code := p.wait(t); code != exitOK {
			t.Fatalf("exit %d: %s", code, p.stderr.String())
		}
		p2 := startProxyProcess(t, args...)
		again := send(t, "POST", p2.base+"/pay", "sigterm", "x")
		if again.status != http.StatusCreated || again.body != r.body || again.header.Get("Idempotent-Replayed") != "true" || up.runs.Load() != 1 {
			t.Fatalf("after a restart: %d %q, runs %d", again.status, again.body, up.runs.Load())
		}
	})
	t.Run("abandoned", func(t *testing.T) {
		up := newGatedUpstream(t, false)
		db := filepath.Join(t.TempDir(), "keys.db")
		args := []string{"--upstream", up.srv.URL, "--single-tenant", "--store", "sqlite", "--path", db, "--upstream-timeout", "20s", "--lease", "30s"}
		p := startProxyProcess(t, append(args, "--shutdown-timeout", "200ms")...)
		go func() {
			req, _ := http.NewRequest("POST", p.base+"/pay", strings.NewReader("x"))
			req.Header.Set("Idempotency-Key", "abandoned")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
		up.waitStarted(t)
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		p.wait(t)
		up.open()
		p2 := startProxyProcess(t, args...)
		r := send(t, "POST", p2.base+"/pay", "abandoned", "x")
		if r.status != http.StatusConflict || up.runs.Load() != 1 {
			t.Fatalf("retry of a call abandoned at shutdown: %d %q, runs %d; want 409 and 1 run", r.status, r.body, up.runs.Load())
		}
	})
}

// vmRSS reads a process's resident set size in bytes from /proc.
func vmRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Skipf("no /proc: %v", err)
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatal("no VmRSS")
	return 0
}

// TestProxySlowBodiesBoundedMemory: 1,000 connections that each declare a
// 1 MiB body and send one byte cost the proxy memory for what arrived, not
// for what was declared (on fe68bc5 they took it from 26 to 1,523 MiB).
func TestProxySlowBodiesBoundedMemory(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc")
	}
	up := newUpstream(t)
	p := startProxyProcess(t, "--upstream", up.srv.URL, "--single-tenant", "--read-timeout", "2m", "--max-body", strconv.Itoa(1<<20))
	before := vmRSS(t, p.cmd.Process.Pid)
	const conns = 1000
	addr := strings.TrimPrefix(p.base, "http://")
	cs := make([]net.Conn, 0, conns)
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	for i := range conns {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		cs = append(cs, c)
		fmt.Fprintf(c, "POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: slow-%d\r\nContent-Length: %d\r\n\r\na", i, 1<<20)
	}
	// Let the proxy read what was sent (nothing is asserted on time).
	var after int64
	for range 20 {
		time.Sleep(100 * time.Millisecond)
		after = max(after, vmRSS(t, p.cmd.Process.Pid))
	}
	grew := after - before
	t.Logf("RSS %d MiB -> %d MiB with %d slow bodies", before>>20, after>>20, conns)
	if grew > 200<<20 {
		t.Fatalf("RSS grew by %d MiB for %d connections that sent one byte each; want under 200 MiB (the declared bodies would be 1,000 MiB)", grew>>20, conns)
	}
	// The proxy still serves.
	if r := send(t, "POST", p.base+"/pay", "after-slow", "x"); r.status != http.StatusCreated {
		t.Fatalf("after the slow bodies: %d", r.status)
	}
}
