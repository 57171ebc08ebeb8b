package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/dedupkit/dedup/internal/verify"
)

// progressBar shows a run's progress on stderr: one line rewritten in
// place on a terminal, an occasional plain line otherwise (a log file or a
// CI console should not fill up with bars).
type progressBar struct {
	w        io.Writer
	tty      bool
	every    time.Duration // how often a plain line is written
	lastLine time.Duration // elapsed time of the last plain line
	drawn    int           // width of the bar on screen, to clear it
}

const barWidth = 30

func newProgressBar(w io.Writer) *progressBar {
	return &progressBar{w: w, tty: isTerminal(w), every: 2 * time.Second}
}

// isTerminal reports whether w is a character device, such as a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

func (p *progressBar) update(pr verify.Progress) {
	frac := 0.0
	if pr.Messages > 0 {
		frac = float64(pr.Done) / float64(pr.Messages)
	}
	if !p.tty {
		if pr.Elapsed-p.lastLine < p.every || pr.Done == pr.Messages {
			return
		}
		p.lastLine = pr.Elapsed
		fmt.Fprintf(p.w, "dedup verify: %d/%d messages done (%.0f%%), %d deliveries, %.1fs\n",
			pr.Done, pr.Messages, 100*frac, pr.Deliveries, pr.Elapsed.Seconds())
		return
	}
	fill := int(frac * barWidth)
	line := fmt.Sprintf("\r[%s%s] %3.0f%%  %d/%d messages  %d deliveries  %.1fs",
		strings.Repeat("#", fill), strings.Repeat(".", barWidth-fill),
		100*frac, pr.Done, pr.Messages, pr.Deliveries, pr.Elapsed.Seconds())
	if pad := p.drawn - len(line); pad > 0 {
		line += strings.Repeat(" ", pad)
	}
	p.drawn = len(line)
	io.WriteString(p.w, line)
}

// finish clears the bar so that the summary starts on a clean line.
func (p *progressBar) finish() {
	if p.tty && p.drawn > 0 {
		io.WriteString(p.w, "\r"+strings.Repeat(" ", p.drawn)+"\r")
		p.drawn = 0
	}
}
