// Package fault is walbox's one error vocabulary: what an error means for
// what walbox does next. Three different things have been called
// "permanent"; each has its own name:
//
//   - NeedsFix (ConfigError, PreconditionError): a setting, a privilege or
//     a server parameter is wrong. Retrying or reconnecting cannot help;
//     walbox stops and the error says what to change.
//   - relay.Permanent (an ErrorClass): this one event can never be
//     delivered as it is; it is dead-lettered and the relay goes on.
//   - consumer.Permanent (in the consumer library, its own module): the
//     handler says the message will never succeed; it is not redelivered.
//
// Everything else is an outage: waited out with back-off. PostgreSQL's
// error codes that walbox reacts to are named here once (the model is
// nats.go's jetstream/errors.go).
package fault

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

// NeedsFix reports whether err is a ConfigError or a PreconditionError:
// someone must change something; reconnecting cannot cure it.
func NeedsFix(err error) bool {
	var ce *ConfigError
	var pe *PreconditionError
	return errors.As(err, &ce) || errors.As(err, &pe)
}

// SQLSTATE codes walbox reacts to.
const (
	UndefinedTable         = "42P01" // relation does not exist
	UndefinedSchema        = "3F000" // schema does not exist
	UndefinedObject        = "42704" // e.g. replication slot does not exist
	UndefinedColumn        = "42703"
	InsufficientPrivilege  = "42501"
	ObjectInUse            = "55006" // e.g. replication slot active for another PID
	ObjectNotInPrereqState = "55000" // slot invalidated, or wal_level too low
	LockNotAvailable       = "55P03" // lock_timeout
	QueryCanceled          = "57014" // statement_timeout, or a cancel request
	InvalidPassword        = "28P01"
	InvalidAuthorization   = "28000" // also: no pg_hba.conf entry for replication
	InvalidCatalogName     = "3D000" // database does not exist
)

// SQLState returns the SQLSTATE of a PostgreSQL error in err's chain, or "".
func SQLState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// MissingRelation reports whether err says a table or its schema does not
// exist.
func MissingRelation(err error) bool {
	switch SQLState(err) {
	case UndefinedTable, UndefinedSchema:
		return true
	}
	return false
}

// Transient reports whether a PostgreSQL statement that failed with err
// may succeed when tried again: no server answer at all (network, EOF, a
// closed connection, a timeout), or a server error of class connection
// (08), transaction rollback such as serialization (40), insufficient
// resources (53), operator intervention such as a shutdown (57), system
// error (58), invalid transaction state (25), or a lock or object held by
// another session.
func Transient(err error) bool {
	code := SQLState(err)
	if code == "" {
		return true
	}
	switch code[:2] {
	case "08", "40", "53", "57", "58", "25":
		return true
	}
	return code == LockNotAvailable || code == ObjectInUse
}
