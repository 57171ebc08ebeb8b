package main

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
)

// TestUpstream: a POST gets 201 and a new id each time it really runs,
// other methods 200, and /stats counts what was handled; an interrupt
// stops it.
func TestUpstream(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve(ctx, ln, io.Discard) }()
	url := "http://" + ln.Addr().String()
	post := func() map[string]any {
		resp, err := http.Post(url+"/payments", "application/json", strings.NewReader(`{"amount":250}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("POST: status %d, want 201", resp.StatusCode)
		}
		var m map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
			t.Fatal(err)
		}
		return m
	}
	a, b := post(), post()
	if a["id"] == b["id"] || a["request"].(map[string]any)["amount"] != 250.0 {
		t.Errorf("two POSTs: %v and %v, want two ids and the request echoed", a, b)
	}
	resp, err := http.Get(url + "/stats")
	if err != nil {
		t.Fatal(err)
	}
	var st map[string]int64
	json.NewDecoder(resp.Body).Decode(&st)
	resp.Body.Close()
	if st["handled"] != 2 {
		t.Errorf("stats %v, want 2 handled", st)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("serve: %v", err)
	}
}
