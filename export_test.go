package dedup

// Heartbeat reports whether pb's heartbeat was started and whether it was
// told to stop (it then arms no further beat).
func Heartbeat(pb *PendingBatch) (started, stopped bool) {
	b := pb.b
	b.mu.Lock()
	defer b.mu.Unlock()
	return pb.beats, b.stopping
}
