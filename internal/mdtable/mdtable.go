// Package mdtable reads the tables of a Markdown document, for tests that
// keep docs and code in step (the error tables of docs/operations.md).
package mdtable

import "strings"

// Rows returns the rows of the first table under heading (a line of doc that
// starts with it), by their first cell with backquotes removed. The header
// row (first cell "code" or "name") and the separator row are left out.
func Rows(doc, heading string) map[string]string {
	i := strings.Index(doc, "\n"+heading)
	if i < 0 {
		return nil
	}
	rows := map[string]string{}
	inTable := false
	for _, line := range strings.Split(doc[i+1:], "\n")[1:] {
		if strings.HasPrefix(line, "#") {
			break
		}
		if !strings.HasPrefix(line, "|") {
			if inTable {
				break
			}
			continue
		}
		inTable = true
		cells := strings.Split(line, "|")
		if len(cells) < 3 {
			continue
		}
		first := strings.Trim(strings.TrimSpace(cells[1]), "`")
		if first == "name" || first == "code" || strings.HasPrefix(first, "---") {
			continue
		}
		rows[first] = line
	}
	return rows
}
