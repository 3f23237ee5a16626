package ops

import (
	"reflect"
	"regexp"
	"testing"

	"github.com/walbox/walbox/relay/sweep"
)

// Every report a command prints with --json names its keys in snake_case:
// each exported field carries a json tag (Go field names leaked into
// `status --json`).
func TestJSONReportsUseSnakeCaseKeys(t *testing.T) {
	snake := regexp.MustCompile(`^[a-z][a-z0-9_]*$`)
	seen := map[reflect.Type]bool{}
	var walk func(tp reflect.Type, path string)
	walk = func(tp reflect.Type, path string) {
		for tp.Kind() == reflect.Pointer || tp.Kind() == reflect.Slice || tp.Kind() == reflect.Map || tp.Kind() == reflect.Array {
			tp = tp.Elem()
		}
		if tp.Kind() != reflect.Struct || seen[tp] || tp.PkgPath() == "time" {
			return
		}
		seen[tp] = true
		for f := range tp.Fields() {
			if !f.IsExported() {
				continue
			}
			name := f.Tag.Get("json")
			if i := len(name); i > 0 {
				for j, c := range name {
					if c == ',' {
						name = name[:j]
						break
					}
				}
			}
			if name == "-" {
				continue
			}
			if !snake.MatchString(name) {
				t.Errorf("%s.%s (%s): json key %q, want snake_case", path, f.Name, tp, name)
				continue
			}
			walk(f.Type, path+"."+name)
		}
	}
	for _, v := range []any{StatusReport{}, SlotReport{}, DoctorReport{}, DeadLetter{}, DLQRetryResult{}, ReplayResult{}, sweep.Report{}} {
		walk(reflect.TypeOf(v), reflect.TypeOf(v).Name())
	}
}
