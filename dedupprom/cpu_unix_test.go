//go:build unix

package dedupprom_test

import "syscall"

// cpuNanos returns the process's user and system CPU time: on a loaded
// machine it measures the work done rather than the time spent waiting
// for a core.
func cpuNanos() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}
