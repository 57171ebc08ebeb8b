package outbox

// WithoutPipelinedMarks makes a relay mark each batch before it publishes
// the next (as before marks were pipelined), for benchmarks that measure
// what pipelining buys.
func WithoutPipelinedMarks() Option { return optionFunc(func(c *config) { c.noPipeline = true }) }
