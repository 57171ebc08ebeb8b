package deduphttp

import (
	"bytes"
	"net/http"
	"reflect"
	"testing"
)

func FuzzDecodeResponse(f *testing.F) {
	good := (&storedResponse{status: 201, header: http.Header{"Content-Type": {"a/b"}, "Location": {"/x", "/y"}}, body: []byte("hi")}).encode()
	f.Add(good)
	f.Add([]byte{1, 0, 200, 0})
	f.Add([]byte{1, 0, 200, 5, 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeResponse(b)
		if err != nil {
			return
		}
		again, err := decodeResponse(r.encode())
		if err != nil || again.status != r.status || !bytes.Equal(again.body, r.body) || len(again.header) != len(r.header) {
			t.Fatalf("re-encoding changed the response: %+v vs %+v (%v)", again, r, err)
		}
	})
}

func TestEncodeRoundTrip(t *testing.T) {
	in := storedResponse{status: 422, header: http.Header{"Content-Type": {"application/json"}, "Etag": {`"1"`}}, body: []byte(`{"x":1}`)}
	out, err := decodeResponse(in.encode())
	if err != nil || out.status != in.status || !reflect.DeepEqual(out.header, in.header) || !bytes.Equal(out.body, in.body) {
		t.Fatalf("round trip: %+v, %v", out, err)
	}
	empty, err := decodeResponse((&storedResponse{status: 204}).encode())
	if err != nil || empty.status != 204 || len(empty.body) != 0 {
		t.Fatalf("empty: %+v %v", empty, err)
	}
}

func FuzzScopedKey(f *testing.F) {
	f.Add("a/b", "POST", "/x", "a", "POST", "b//x")
	f.Add("", "POST", "/x", "", "POST", "/x")
	f.Fuzz(func(t *testing.T, t1, m1, r1, t2, m2, r2 string) {
		k1, k2 := scopedKey(t1, "", m1, r1, "id"), scopedKey(t2, "", m2, r2, "id")
		if (t1 == t2 && m1 == m2 && r1 == r2) != (k1 == k2) {
			t.Fatalf("scopes %q and %q for (%q %q %q) and (%q %q %q)", k1.Scope, k2.Scope, t1, m1, r1, t2, m2, r2)
		}
		if err := k1.Validate(); err != nil {
			t.Fatalf("scope of (%q %q %q): %v", t1, m1, r1, err)
		}
	})
}
