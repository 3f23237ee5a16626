package ops

import (
	"fmt"
	"io"
	"time"

	"github.com/schollz/progressbar/v3"
)

// progress shows how far a long operation is: a progress bar on a terminal,
// otherwise a line every few seconds (and none for short runs).
type progress struct {
	bar   *progressbar.ProgressBar
	w     io.Writer
	label string
	total int64
	done  int64
	every time.Duration
	last  time.Time
	extra func() string
}

// newProgress starts a progress display for total steps on w. extra, if
// set, adds a status text to the periodic lines.
func newProgress(w io.Writer, tty bool, label string, total int64, extra func() string) *progress {
	p := &progress{w: w, label: label, total: total, every: 2 * time.Second, last: time.Now(), extra: extra}
	if w == nil {
		p.w = io.Discard
		return p
	}
	if tty {
		p.bar = progressbar.NewOptions64(total,
			progressbar.OptionSetWriter(w),
			progressbar.OptionSetDescription(label),
			progressbar.OptionShowCount(),
			progressbar.OptionShowIts(),
			progressbar.OptionSetItsString("events"),
			progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionSetPredictTime(true),
			progressbar.OptionFullWidth(),
			progressbar.OptionClearOnFinish(),
		)
	}
	return p
}

func (p *progress) add(n int64) {
	p.done += n
	if p.bar != nil {
		_ = p.bar.Add64(n)
		return
	}
	if time.Since(p.last) >= p.every {
		p.last = time.Now()
		p.line()
	}
}

func (p *progress) line() {
	pct := 100.0
	if p.total > 0 {
		pct = float64(p.done) * 100 / float64(p.total)
	}
	s := fmt.Sprintf("%s: %d/%d (%.0f%%)", p.label, p.done, p.total, pct)
	if p.extra != nil {
		s += " " + p.extra()
	}
	fmt.Fprintln(p.w, s)
}

func (p *progress) finish() {
	if p.bar != nil {
		_ = p.bar.Finish()
	}
}
