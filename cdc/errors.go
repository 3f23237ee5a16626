package cdc

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
)

// ConfigError is a problem with walbox's configuration: it names the key and
// what to change. Retrying does not help.
type ConfigError struct {
	Key string
	Msg string
}

func (e *ConfigError) Error() string { return fmt.Sprintf("config %s: %s", e.Key, e.Msg) }

// PreconditionError is a server setting or privilege walbox needs. Fix says
// what a DBA has to do. Retrying does not help until someone does it.
type PreconditionError struct {
	What string
	Fix  string
	Err  error
}

func (e *PreconditionError) Error() string {
	s := e.What + "; " + e.Fix
	if e.Err != nil {
		s += " (" + e.Err.Error() + ")"
	}
	return s
}

func (e *PreconditionError) Unwrap() error { return e.Err }

// ErrSlotLost reports that the replication slot was dropped or invalidated
// while walbox depended on it.
var ErrSlotLost = errors.New("replication slot lost")

// IsPermanent reports whether err cannot be cured by reconnecting.
func IsPermanent(err error) bool {
	var ce *ConfigError
	var pe *PreconditionError
	return errors.As(err, &ce) || errors.As(err, &pe)
}

// sqlState returns the SQLSTATE of a Postgres error, or "".
func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// SQLSTATE codes walbox reacts to.
const (
	stateUndefinedObject        = "42704" // replication slot does not exist
	stateObjectInUse            = "55006" // replication slot is active for another PID
	stateObjectNotInPrereqState = "55000" // slot invalidated, or wal_level too low
	stateInsufficientPrivilege  = "42501"
	stateInvalidPassword        = "28P01"
	stateInvalidCatalogName     = "3D000" // database does not exist
	stateInvalidAuthorization   = "28000" // also: no pg_hba.conf entry for replication
)
