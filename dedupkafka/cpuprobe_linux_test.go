//go:build linux

package dedupkafka

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cpuWindow measures the CPU used during a benchmark's timed window: this
// process's, PostgreSQL's (the processes whose parent is the postmaster
// named by DEDUP_BENCH_PG_PID, when set: a private server, so that its
// figure is the benchmark's alone) and the whole machine's. Call the
// returned function at the window's end; it returns a line for b.Log.
// A relay that is working uses the machine's cores; one that is waiting
// leaves them idle (BenchmarkRelay logs it with -v).
func cpuWindow() func() string {
	pg, _ := strconv.Atoi(os.Getenv("DEDUP_BENCH_PG_PID"))
	t0, self0, pg0 := time.Now(), selfCPU(), childrenCPU(pg)
	busy0, all0 := machineCPU()
	return func() string {
		wall := time.Since(t0).Seconds()
		busy1, all1 := machineCPU()
		s := fmt.Sprintf("window %.0f ms, cores used: bench %.2f", wall*1000, (selfCPU()-self0)/wall)
		if pg > 0 {
			s += fmt.Sprintf(", postgres %.2f", (childrenCPU(pg)-pg0)/wall)
		}
		if all1 > all0 {
			s += fmt.Sprintf(", machine %.2f of %d", (busy1-busy0)/(all1-all0)*float64(cpus()), cpus())
		}
		return s
	}
}

func selfCPU() float64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

const clockTicks = 100 // USER_HZ on Linux

// childrenCPU is the CPU seconds of the live processes whose parent is
// ppid (and of ppid itself).
func childrenCPU(ppid int) float64 {
	if ppid <= 0 {
		return 0
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	var ticks int64
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		raw, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		f := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+2:]))
		if len(f) < 13 {
			continue
		}
		pp, _ := strconv.Atoi(f[1])
		if pp != ppid && e.Name() != strconv.Itoa(ppid) {
			continue
		}
		u, _ := strconv.ParseInt(f[11], 10, 64)
		s, _ := strconv.ParseInt(f[12], 10, 64)
		ticks += u + s
	}
	return float64(ticks) / clockTicks
}

// machineCPU returns the busy and total jiffies of all CPUs.
func machineCPU() (busy, all float64) {
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line)
	for i, v := range f[1:] {
		n, _ := strconv.ParseFloat(v, 64)
		all += n
		if i != 3 && i != 4 { // idle, iowait
			busy += n
		}
	}
	return busy, all
}

func cpus() int {
	raw, _ := os.ReadFile("/proc/stat")
	n := 0
	for _, l := range strings.Split(string(raw), "\n") {
		if strings.HasPrefix(l, "cpu") && !strings.HasPrefix(l, "cpu ") {
			n++
		}
	}
	return n
}
