package guard_test

import (
	"errors"
	"math"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/guard"
)

func TestCompareVersion(t *testing.T) {
	t.Parallel()
	tests := []struct {
		stored, incoming uint64
		want             guard.Verdict
	}{
		{0, 1, guard.Apply},
		{0, 0, guard.Duplicate},
		{0, 2, guard.Gap},
		{4, 5, guard.Apply},
		{5, 5, guard.Duplicate},
		{5, 4, guard.Stale},
		{5, 0, guard.Stale},
		{5, 7, guard.Gap},
		{5, math.MaxUint64, guard.Gap},
		{math.MaxUint64 - 1, math.MaxUint64, guard.Apply},
		{math.MaxUint64, math.MaxUint64, guard.Duplicate},
		{math.MaxUint64, 0, guard.Stale},
	}
	for _, tt := range tests {
		if got := guard.CompareVersion(tt.stored, tt.incoming); got != tt.want {
			t.Errorf("CompareVersion(%d, %d) = %v, want %v", tt.stored, tt.incoming, got, tt.want)
		}
	}
}

func TestDecide(t *testing.T) {
	t.Parallel()
	tests := []struct {
		stored, incoming uint64
		policy           guard.GapPolicy
		want             guard.Action
	}{
		{4, 5, guard.GapPark, guard.ActionApply},
		{4, 5, guard.GapReject, guard.ActionApply},
		{5, 5, guard.GapAllow, guard.ActionSkip},
		{5, 4, guard.GapAllow, guard.ActionSkip},
		{5, 4, guard.GapPark, guard.ActionSkip},
		{5, 7, guard.GapPark, guard.ActionPark},
		{5, 7, guard.GapReject, guard.ActionReject},
		{5, 7, guard.GapAllow, guard.ActionApply},
		{5, 7, guard.GapPolicy(99), guard.ActionReject},
	}
	for _, tt := range tests {
		if got := guard.Decide(tt.stored, tt.incoming, tt.policy); got != tt.want {
			t.Errorf("Decide(%d, %d, %v) = %v, want %v", tt.stored, tt.incoming, tt.policy, got, tt.want)
		}
	}
	var zero guard.GapPolicy
	if zero != guard.GapPark {
		t.Errorf("zero GapPolicy = %v, want park", zero)
	}
}

func TestStrings(t *testing.T) {
	t.Parallel()
	tests := []struct {
		v    interface{ String() string }
		want string
	}{
		{guard.Apply, "apply"},
		{guard.Duplicate, "duplicate"},
		{guard.Stale, "stale"},
		{guard.Gap, "gap"},
		{guard.Verdict(0), "verdict(0)"},
		{guard.GapPark, "park"},
		{guard.GapReject, "reject"},
		{guard.GapAllow, "allow"},
		{guard.GapPolicy(9), "gappolicy(9)"},
		{guard.ActionApply, "apply"},
		{guard.ActionSkip, "skip"},
		{guard.ActionPark, "park"},
		{guard.ActionReject, "reject"},
		{guard.Action(0), "action(0)"},
		{guard.Applied, "applied"},
		{guard.AlreadyApplied, "already applied"},
		{guard.UnexpectedState, "unexpected state"},
		{guard.TransitionResult(0), "transitionresult(0)"},
	}
	for _, tt := range tests {
		if got := tt.v.String(); got != tt.want {
			t.Errorf("String() = %q, want %q", got, tt.want)
		}
	}
}

func TestRowsError(t *testing.T) {
	t.Parallel()
	var err error = &guard.RowsError{Rows: 3}
	if !errors.Is(err, guard.ErrMultipleRows) {
		t.Errorf("errors.Is(%v, ErrMultipleRows) = false", err)
	}
	if got, want := err.Error(), "guard: guarded write changed 3 rows, want at most 1"; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	if _, err := guard.NewParked[int](0); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("NewParked(0) error = %v, want ErrInvalidArgument", err)
	}
}
