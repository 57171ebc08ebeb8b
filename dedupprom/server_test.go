package dedupprom_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/dedupprom"
)

func TestListen(t *testing.T) {
	m, reg := newMetrics(t)
	m.OnDuplicate(context.Background(), dedup.DuplicateEvent{Store: "window", Key: dedup.Key{Scope: "s", ID: "1"}})
	srv, err := dedupprom.Listen("127.0.0.1:0", reg)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://" + srv.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `dedup_duplicates_total{scope="s",store="window"} 1`) {
		t.Errorf("/metrics:\n%s", body)
	}
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := http.Get("http://" + srv.Addr() + "/metrics"); err == nil {
		t.Error("still serving after Close")
	}
	if _, err := dedupprom.Listen("no-port", reg); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("bad address: %v", err)
	}
}
