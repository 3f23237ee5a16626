package e2e

import "github.com/jackc/pglogrepl"

func lsnAtLeast(a, b string) bool {
	x, err1 := pglogrepl.ParseLSN(a)
	y, err2 := pglogrepl.ParseLSN(b)
	return err1 == nil && err2 == nil && x >= y
}
