package fault

import (
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func pg(code string) error { return fmt.Errorf("run: %w", &pgconn.PgError{Code: code}) }

func TestNeedsFix(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&ConfigError{Key: "nats.url", Msg: "is required"}, true},
		{fmt.Errorf("start: %w", &PreconditionError{What: "wal_level is 'replica'", Fix: "set wal_level = logical"}), true},
		{io.EOF, false},
		{pg(InsufficientPrivilege), false},
	} {
		if got := NeedsFix(c.err); got != c.want {
			t.Errorf("NeedsFix(%v) = %v", c.err, got)
		}
	}
	pe := &PreconditionError{What: "w", Fix: "f", Err: io.EOF}
	if !errors.Is(pe, io.EOF) || pe.Error() != "w; f (EOF)" {
		t.Errorf("precondition %q", pe)
	}
}

func TestTransientAndCodes(t *testing.T) {
	for _, c := range []struct {
		err       error
		transient bool
	}{
		{io.ErrUnexpectedEOF, true},
		{pg("08006"), true},          // connection failure
		{pg("40001"), true},          // serialization failure
		{pg("57P01"), true},          // admin shutdown
		{pg(LockNotAvailable), true}, // lock_timeout
		{pg(ObjectInUse), true},      // slot in use
		{pg(UndefinedColumn), false}, // the layout is wrong
		{pg(InsufficientPrivilege), false},
		{pg(UndefinedTable), false},
	} {
		if got := Transient(c.err); got != c.transient {
			t.Errorf("Transient(%v) = %v", c.err, got)
		}
	}
	if !MissingRelation(pg(UndefinedSchema)) || !MissingRelation(pg(UndefinedTable)) || MissingRelation(pg(InsufficientPrivilege)) || MissingRelation(io.EOF) {
		t.Error("MissingRelation")
	}
	if SQLState(io.EOF) != "" || SQLState(pg(InvalidPassword)) != InvalidPassword {
		t.Error("SQLState")
	}
}
