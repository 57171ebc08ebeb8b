//go:build !linux

package dedupkafka

// cpuWindow measures nothing off Linux (see cpuprobe_linux_test.go).
func cpuWindow() func() string { return func() string { return "" } }
