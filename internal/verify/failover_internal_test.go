package verify

import "testing"

// TestParseClusterNodes reads a CLUSTER NODES reply as it comes over RESP3
// (a verbatim string with its txt: tag stripped by nodeDo) and picks
// masters with their replicas in address order.
func TestParseClusterNodes(t *testing.T) {
	reply := "d5ca 127.0.0.1:7102@17102 master - 0 1 3 connected 10923-16383\n" +
		"4899 127.0.0.1:7104@17104 master - 0 1 7 connected 5461-10922\n" +
		"da1b 127.0.0.1:7105@17105 slave d5ca 0 1 3 connected\n" +
		"4aff 127.0.0.1:7100@17100 myself,slave ab71 0 1 8 connected\n" +
		"a2f7 127.0.0.1:7101@17101 slave,fail 4899 0 1 7 disconnected\n" +
		"ab71 127.0.0.1:7103@17103 master - 0 1 8 connected 0-5460\n"
	nodes := parseClusterNodes(reply)
	if len(nodes) != 6 {
		t.Fatalf("%d nodes, want 6", len(nodes))
	}
	// 7104's only replica has failed: it is not picked.
	var got []string
	for i := range 4 {
		m, r := pickMaster(nodes, i)
		got = append(got, m.addr+">"+r.addr)
	}
	want := []string{"127.0.0.1:7102>127.0.0.1:7105", "127.0.0.1:7103>127.0.0.1:7100",
		"127.0.0.1:7102>127.0.0.1:7105", "127.0.0.1:7103>127.0.0.1:7100"}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("pick %d: %s, want %s (all: %v)", i, got[i], want[i], got)
		}
	}
	if err := healthy(t.Context(), nodes, 0); err == nil {
		t.Fatal("a cluster with a failed replica reported healthy")
	}
}
