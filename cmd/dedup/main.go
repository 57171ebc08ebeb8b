// Command dedup is the command line of the dedup toolkit.
//
// Its main job is `dedup verify`, a fault-injecting checker that drives an
// at-least-once pipeline against a store and proves, from a business
// ledger, that every message took effect exactly once:
//
//	go run ./cmd/dedup verify
//	go run ./cmd/dedup verify --store memory --consumers 32 --dup-rate 0.5 --crash-rate 0.05
//	go run ./cmd/dedup verify --json
//	go run ./cmd/dedup verify --store postgres --consumers 32 --dup-rate 0.5 --crash-rate 0.05
//
// `dedup migrate` creates the PostgreSQL store's schema and `dedup sweep`
// deletes its expired records in bounded batches. `dedup version` prints
// the module version and VCS revision the binary was built from.
//
// Flags may come before or after a command's positional arguments
// (`dedup dlq inspect 42 --payload`); "--" ends the flags.
//
// Run `dedup help` for the commands and `dedup verify -h` for the flags.
//
// Exit status: 0 when every check passed, 1 when a check failed (a message
// lost or applied twice, a timeout, a store that could not be opened), 2
// for bad usage.
package main

import (
	"fmt"
	"io"
	"os"
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// Exit statuses.
const (
	exitOK    = 0
	exitFail  = 1
	exitUsage = 2
)

// command is one subcommand.
type command struct {
	name    string
	summary string
	run     func(args []string, stdout, stderr io.Writer) int // nil: not yet implemented
}

func commands() []command {
	return []command{
		{"verify", "drive an at-least-once pipeline with injected faults against a store and check every message took effect exactly once", runVerify},
		{"proxy", "an HTTP idempotency reverse proxy: Idempotency-Key semantics in front of any HTTP service", runProxy},
		{"migrate", "create or upgrade the schema of the PostgreSQL store", runMigrate},
		{"sweep", "delete expired records from the PostgreSQL store in bounded batches", runSweep},
		{"relay", "run the outbox relay: publish outbox rows (PostgreSQL or SQLite) to NATS JetStream in commit order per key", runRelay},
		{"outbox", "outbox status, list, and retry or drop of quarantined rows (PostgreSQL)", runOutbox},
		{"dlq", "list, inspect and replay dead-lettered messages under their original IDs (NATS dead-letter streams)", runDLQ},
		{"version", "print the module version, VCS revision and Go version of this binary", runVersion},
	}
}

// run is the whole program: it parses args (without the program name),
// writes to stdout and stderr, and returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		usage(stderr)
		return exitUsage
	}
	name := args[0]
	switch name {
	case "-version", "--version":
		return runVersion(nil, stdout, stderr)
	case "help", "-h", "-help", "--help":
		if len(args) > 1 && name == "help" {
			return run([]string{args[1], "-h"}, stdout, stderr)
		}
		usage(stdout)
		return exitOK
	}
	for _, c := range commands() {
		if c.name != name {
			continue
		}
		if c.run == nil {
			fmt.Fprintf(stderr, "dedup %s: not yet implemented (%s).\nRun 'dedup help' for the commands that work today.\n", c.name, c.summary)
			return exitUsage
		}
		return c.run(args[1:], stdout, stderr)
	}
	fmt.Fprintf(stderr, "dedup: unknown command %q\nRun 'dedup help' for the list of commands.\n", name)
	return exitUsage
}

func usage(w io.Writer) {
	fmt.Fprint(w, `dedup: exactly-once effects over at-least-once delivery.

Usage:

	dedup <command> [flags]

Commands:
`)
	for _, c := range commands() {
		note := ""
		if c.run == nil {
			note = " (not yet implemented)"
		}
		fmt.Fprintf(w, "\t%-8s %s%s\n", c.name, c.summary, note)
	}
	fmt.Fprint(w, `
Run 'dedup help <command>' or 'dedup <command> -h' for a command's flags.
Flags may come before or after a command's arguments; "--" ends them.
`)
}
