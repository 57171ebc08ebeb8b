package verify

import (
	"slices"
	"testing"
)

func TestMsgIDRoundTrip(t *testing.T) {
	b := newBroker(Config{Messages: 20_000_000, Seed: 1}, "run-")
	for _, seq := range []int{0, 5, 10, 999_999, 1_000_000, 9_999_999, 10_000_000, 19_999_999} {
		id := b.msgID(seq)
		if len(id) < len("run-")+7 {
			t.Errorf("msgID(%d) = %q, shorter than 7 digits", seq, id)
		}
		if got, ok := b.parseMsgID(id); !ok || got != seq {
			t.Errorf("parseMsgID(%q) = %d, %v", id, got, ok)
		}
	}
	for _, id := range []string{"run-1", "run-00000001", "other-0000001", "run-+000001", "run-20000000", "run--000001"} {
		if seq, ok := b.parseMsgID(id); ok {
			t.Errorf("parseMsgID(%q) = %d, want not ours", id, seq)
		}
	}
}

func TestJudge(t *testing.T) {
	b := newBroker(Config{Messages: 6, Seed: 1}, "r-")
	b.next = 5       // message 5 was never published
	b.pending[3] = 1 // message 3 is still unacknowledged
	b.done = 4
	effects := map[string]int{
		b.msgID(0): 1,
		b.msgID(1): 3, // applied three times
		// message 2: acknowledged, never applied
		// message 3: unfinished, not lost
		b.msgID(4):  1,
		"r-9999999": 2, // never published
		"r-05":      1, // not one of ours either
	}
	b.judge(effects)
	r := b.report
	if r.Effects != 8 || r.DoubleApplied != 1 || r.Lost != 1 || r.Unfinished != 2 || r.StrayEffects != 3 {
		t.Fatalf("effects %d double %d lost %d unfinished %d stray %d, want 8 1 1 2 3", r.Effects, r.DoubleApplied, r.Lost, r.Unfinished, r.StrayEffects)
	}
	if !slices.Equal(r.LostSample, []string{"r-0000002"}) || !slices.Equal(r.DoubleSample, []string{"r-0000001 x3"}) {
		t.Errorf("samples %v %v", r.LostSample, r.DoubleSample)
	}
}

func TestFIFO(t *testing.T) {
	var q fifo
	next, want := 0, 0
	for round := range 100 {
		for range round % 7 {
			q.push(Delivery{Seq: next})
			next++
		}
		for range round % 5 {
			if q.len() == 0 {
				break
			}
			if got := q.front().Seq; got != want {
				t.Fatalf("front = %d, want %d", got, want)
			}
			q.pop()
			want++
		}
	}
	if q.len() != next-want {
		t.Fatalf("len = %d, want %d", q.len(), next-want)
	}
}
