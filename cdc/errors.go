package cdc

import (
	"errors"

	"github.com/walbox/walbox/internal/fault"
)

// ConfigError is a problem with walbox's configuration (fault.ConfigError):
// it names the key and what to change.
type ConfigError = fault.ConfigError

// PreconditionError is a server setting or privilege walbox needs
// (fault.PreconditionError): Fix says what a DBA has to do.
type PreconditionError = fault.PreconditionError

// ErrSlotLost reports that the replication slot was dropped or invalidated
// while walbox depended on it.
var ErrSlotLost = errors.New("replication slot lost")

// IsPermanent reports whether err cannot be cured by reconnecting: a
// configuration or precondition someone must fix (fault.NeedsFix).
func IsPermanent(err error) bool { return fault.NeedsFix(err) }

// sqlState returns the SQLSTATE of a Postgres error, or "".
func sqlState(err error) string { return fault.SQLState(err) }

// SQLSTATE codes walbox reacts to (named in package fault).
const (
	stateUndefinedObject        = fault.UndefinedObject
	stateObjectInUse            = fault.ObjectInUse
	stateObjectNotInPrereqState = fault.ObjectNotInPrereqState
	stateInsufficientPrivilege  = fault.InsufficientPrivilege
	stateInvalidPassword        = fault.InvalidPassword
	stateInvalidCatalogName     = fault.InvalidCatalogName
	stateInvalidAuthorization   = fault.InvalidAuthorization
)
