package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"runtime/debug"
)

const versionAbout = `Usage: dedup version [--json]

Prints the module version of this dedup binary, the VCS revision and time
it was built from (with "+dirty" when the tree had uncommitted changes),
and the Go version that built it, as recorded by the Go toolchain.

Flags:
`

// buildVersion is what `dedup version` prints.
type buildVersion struct {
	Module   string `json:"module"`
	Version  string `json:"version"`
	Revision string `json:"revision,omitempty"`
	Time     string `json:"time,omitempty"`
	Modified bool   `json:"modified"`
	Go       string `json:"go"`
}

// readVersion reads the build information the toolchain embedded.
func readVersion(info *debug.BuildInfo, ok bool) buildVersion {
	v := buildVersion{Module: "github.com/dedupkit/dedup", Version: "unknown"}
	if !ok {
		return v
	}
	v.Go = info.GoVersion
	if info.Main.Path != "" {
		v.Module = info.Main.Path
	}
	if info.Main.Version != "" {
		v.Version = info.Main.Version
	}
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Revision = s.Value
		case "vcs.time":
			v.Time = s.Value
		case "vcs.modified":
			v.Modified = s.Value == "true"
		}
	}
	return v
}

func (v buildVersion) String() string {
	s := fmt.Sprintf("dedup %s (%s)", v.Version, v.Module)
	if v.Revision == "" {
		s += " revision unknown (built without VCS stamping: -buildvcs=false, or outside a git checkout)"
	} else {
		s += " revision " + v.Revision
		if v.Modified {
			s += "+dirty"
		}
		if v.Time != "" {
			s += " of " + v.Time
		}
	}
	if v.Go != "" {
		s += ", built with " + v.Go
	}
	return s
}

func runVersion(args []string, stdout, stderr io.Writer) int {
	var asJSON bool
	fs := flag.NewFlagSet("dedup version", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.BoolVar(&asJSON, "json", false, "print one JSON object")
	if err := parseCommand(fs, args, versionAbout, stdout); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return exitOK
		}
		fmt.Fprintf(stderr, "dedup version: %v\nRun 'dedup version -h' for the flags.\n", err)
		return exitUsage
	}
	v := readVersion(debug.ReadBuildInfo())
	if asJSON {
		return writeJSON(stdout, stderr, "version", v)
	}
	fmt.Fprintln(stdout, v)
	return exitOK
}
