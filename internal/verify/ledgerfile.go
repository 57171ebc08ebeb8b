package verify

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// fileLedger is lease mode's business table when several processes share
// a run: every effect is one line "msgID pid" appended to one file with
// O_APPEND, in a single write, so lines of different processes never
// interleave and a line written before a SIGKILL is kept (the kernel holds
// it, not the process).
type fileLedger struct {
	path string
	f    *os.File
	pid  string
}

func openFileLedger(path string) (*fileLedger, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open the ledger file: %w", err)
	}
	return &fileLedger{path: path, f: f, pid: strconv.Itoa(os.Getpid())}, nil
}

func (l *fileLedger) add(msgID string) error {
	if strings.ContainsAny(msgID, " \n") {
		return fmt.Errorf("ledger: message ID %q holds a space or newline", msgID)
	}
	_, err := l.f.Write([]byte(msgID + " " + l.pid + "\n"))
	return err
}

func (l *fileLedger) close() error { return l.f.Close() }

func (l *fileLedger) counts(prefix string) (map[string]int, error) {
	rows, err := l.rows(prefix)
	out := make(map[string]int, len(rows))
	for id, pids := range rows {
		out[id] = len(pids)
	}
	return out, err
}

// rows returns, per message ID that starts with prefix, the pids of the
// processes that applied it, in ledger order.
func (l *fileLedger) rows(prefix string) (map[string][]int, error) {
	f, err := os.Open(l.path)
	if err != nil {
		return nil, fmt.Errorf("read the ledger file: %w", err)
	}
	defer f.Close()
	out := map[string][]int{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		id, pid, ok := strings.Cut(sc.Text(), " ")
		n, err := strconv.Atoi(pid)
		if !ok || err != nil {
			return nil, fmt.Errorf("read the ledger file: bad line %q", sc.Text())
		}
		if strings.HasPrefix(id, prefix) {
			out[id] = append(out[id], n)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, errors.Join(errors.New("read the ledger file"), err)
	}
	return out, nil
}
