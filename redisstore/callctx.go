package redisstore

import "context"

// A call to Redis runs on a context derived from its caller's by callCtx:
// the caller's values and deadline, not its bare cancellation. Why:
//
//   - Once a request is on the wire its outcome is only known from its
//     reply. A claim given up on may have run (its lease then holds the
//     key until it ends, and the message waits that long); a completion
//     given up on may have completed. Waiting for the reply turns those
//     unknown outcomes into known ones.
//   - rueidis answers a lone call on an idle connection on the caller's
//     goroutine (no writer and reader goroutines, no hand-offs) only when
//     the call's context has a deadline or cannot be cancelled; a
//     cancellable context without a deadline switches that connection to
//     its goroutine pipeline for good. A consumer's context is exactly
//     that, so every call of a one-worker consumer paid two goroutine
//     hand-offs that a plain client call on context.Background does not
//     (docs/benchmarks.md, dedupamqp with Redis).
//
// What still ends a call: the caller's deadline; for a caller that could
// cancel but set no deadline, the store's call bound (s.callBound: the
// client's ConnWriteTimeout for a store from Open, 10s or
// WithCallTimeout for one from New), given as a deadline, because
// rueidis's own detection of a silent server needs its keep-alive PINGs,
// which a client may have turned off (Dialer.KeepAlive < 0), and a store
// from New cannot see its client's options; the client's ConnWriteTimeout
// (rueidis sets the connection's deadline to it for a call answered on
// the caller's goroutine); closing the client. A caller whose context has
// already ended is refused before anything is sent (Store.begin). A
// deadline keeps rueidis's synchronous path for a lone caller.
func (s *Store) callCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	if ctx.Done() == nil {
		// Background, TODO or already detached: nothing to strip.
		return ctx, noCancel
	}
	bare := context.WithoutCancel(ctx)
	if dl, ok := ctx.Deadline(); ok {
		return context.WithDeadline(bare, dl)
	}
	return context.WithTimeout(bare, s.callBound)
}

func noCancel() {}
