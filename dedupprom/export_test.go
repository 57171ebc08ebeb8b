package dedupprom

import "github.com/prometheus/client_golang/prometheus"

type vecs struct {
	Claims, Duplicates, Takeovers, Finishes, StoreErrors *prometheus.CounterVec
	Decisions, Failures, Redeliveries, HTTPRequests      *prometheus.CounterVec
}

// Collectors exposes the vectors to the tests.
func Collectors(m *Metrics) vecs {
	return vecs{m.claims, m.duplicates, m.takeovers, m.finishes, m.storeErrors, m.decisions, m.failures, m.redeliveries, m.httpRequests}
}
