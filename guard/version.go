package guard

import "strconv"

// Verdict is what an incoming aggregate version means next to the version
// already stored for that aggregate. The zero Verdict is not a valid
// verdict; [CompareVersion] never returns it.
type Verdict uint8

const (
	// Apply: the incoming version is the next one (stored+1). Apply it.
	Apply Verdict = iota + 1
	// Duplicate: the incoming version equals the stored one. It was
	// already applied; acknowledge it and do nothing.
	Duplicate
	// Stale: the incoming version is older than the stored one. Applying
	// it would regress the state; acknowledge it and do nothing.
	Stale
	// Gap: the incoming version is beyond the next one. At least one
	// version in between is missing or was reordered behind this one;
	// what to do is a [GapPolicy] decision.
	Gap
)

// String returns the verdict's name in lower case, such as "apply".
func (v Verdict) String() string {
	switch v {
	case Apply:
		return "apply"
	case Duplicate:
		return "duplicate"
	case Stale:
		return "stale"
	case Gap:
		return "gap"
	}
	return "verdict(" + strconv.Itoa(int(v)) + ")"
}

// CompareVersion classifies an incoming version against the stored one.
// Versions start at 1; a stored version of 0 means nothing has been
// applied yet, so an incoming 1 is [Apply]. An incoming 0 is never a valid
// next version: against a stored 0 it is a [Duplicate], against anything
// else it is [Stale].
func CompareVersion(stored, incoming uint64) Verdict {
	switch {
	case incoming == stored:
		return Duplicate
	case incoming < stored:
		return Stale
	case incoming-stored == 1:
		return Apply
	default:
		return Gap
	}
}

// GapPolicy says what to do with a message whose version leaves a gap.
type GapPolicy uint8

const (
	// GapPark holds the message (see [Parked]) until the missing versions
	// arrive, then re-drives it. Use it when every version matters (event
	// sourcing, a projection that applies deltas) and the stream can be
	// reordered. It is the zero GapPolicy.
	GapPark GapPolicy = iota
	// GapReject refuses the message so the caller can retry it later or
	// dead-letter it. Use it when the transport redelivers (a nack) and
	// the missing version is expected to arrive first on the next attempt.
	GapReject
	// GapAllow applies the message anyway, skipping the missing versions.
	// Use it only when each message carries the full state (a snapshot,
	// "last writer wins" by version), so an intermediate version adds
	// nothing; a late intermediate version then arrives [Stale].
	GapAllow
)

// String returns the policy's name, such as "park".
func (p GapPolicy) String() string {
	switch p {
	case GapPark:
		return "park"
	case GapReject:
		return "reject"
	case GapAllow:
		return "allow"
	}
	return "gappolicy(" + strconv.Itoa(int(p)) + ")"
}

// Action is what a consumer does with a message, from [Decide].
type Action uint8

const (
	// ActionApply: apply the message (through a guarded write, such as
	// [Advance], so a racing copy still applies once).
	ActionApply Action = iota + 1
	// ActionSkip: acknowledge the message without applying it; it is a
	// duplicate or stale.
	ActionSkip
	// ActionPark: keep the message until the gap before it fills.
	ActionPark
	// ActionReject: refuse the message for now (nack, retry later or
	// dead-letter); it is ahead of a missing version.
	ActionReject
)

// String returns the action's name, such as "apply".
func (a Action) String() string {
	switch a {
	case ActionApply:
		return "apply"
	case ActionSkip:
		return "skip"
	case ActionPark:
		return "park"
	case ActionReject:
		return "reject"
	}
	return "action(" + strconv.Itoa(int(a)) + ")"
}

// Decide turns [CompareVersion]'s verdict into an action: Apply applies,
// Duplicate and Stale skip, and a Gap follows policy (park, reject, or
// apply when the policy is [GapAllow]). An unknown policy is treated as
// [GapReject], the choice that neither loses nor misapplies a message.
//
// Decide reads a version the caller loaded earlier, so it is advice, not a
// guarantee: two consumers may both decide to apply. The guarantee comes
// from the conditional write ([Advance]) that checks the version again in
// the same statement that changes the state.
func Decide(stored, incoming uint64, policy GapPolicy) Action {
	switch CompareVersion(stored, incoming) {
	case Apply:
		return ActionApply
	case Duplicate, Stale:
		return ActionSkip
	}
	switch policy {
	case GapPark:
		return ActionPark
	case GapAllow:
		return ActionApply
	default:
		return ActionReject
	}
}
