//go:build !unix

package dedupprom_test

func cpuNanos() int64 { return 0 }
