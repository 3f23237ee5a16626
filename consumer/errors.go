package consumer

import "errors"

// Permanent marks err as not worth retrying (a malformed payload, a
// reference that will never exist): the message is dead-lettered at once.
// Permanent(nil) is nil. The error message is err's, unchanged.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

// IsPermanent reports whether err or an error it wraps came from Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }
