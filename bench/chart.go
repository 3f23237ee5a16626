package main

import (
	"fmt"
	"image/color"
	"os"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// systemColor gives each system the same colour in both panels.
func systemColor(system string) color.Color {
	switch system {
	case "walbox":
		return color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}
	case "walbox, flag off":
		return color.RGBA{R: 0x6b, G: 0xae, B: 0xd6, A: 0xff}
	case "walbox, per message":
		return color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}
	case "polling":
		return color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}
	case "polling-tuned":
		return color.RGBA{R: 0xf0, G: 0x8a, B: 0x8b, A: 0xff}
	case "watermill":
		return color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}
	default: // the ceilings
		return color.RGBA{R: 0x99, G: 0x99, B: 0x99, A: 0xff}
	}
}

// chartRate is the live rate the latency panel shows: 2,000/s, or the
// nearest rate run.
func (r *results) chartRate() (int, bool) {
	best, ok := 0, false
	for _, l := range r.live {
		if !ok || absInt(l.Rate-2000) < absInt(best-2000) {
			best, ok = l.Rate, true
		}
	}
	return best, ok
}

func absInt(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// writeChart draws the PNG: insert → stored latency CDF per system at
// 2,000 events/s, and catch-up throughput bars beside the ceilings.
func (r *results) writeChart(path string) error {
	lat := plot.New()
	rateShown, ok := r.chartRate()
	lat.Title.Text = fmt.Sprintf("Live: insert → JetStream stored latency at %d events/s (CDF)", rateShown)
	lat.X.Label.Text = "latency, ms (log scale)"
	lat.Y.Label.Text = "fraction of events"
	lat.X.Scale = plot.LogScale{}
	lat.X.Tick.Marker = plot.LogTicks{Prec: -1}
	lat.Y.Min, lat.Y.Max = 0, 1
	lat.Legend.Top, lat.Legend.Left = false, false
	lat.Add(plotter.NewGrid())
	if ok {
		series := map[string][]time.Duration{}
		order := []string{"walbox"}
		for _, l := range r.live {
			if l.Rate == rateShown {
				series["walbox"] = l.store
			}
		}
		for _, pr := range r.peers {
			for _, l := range pr.Live {
				if l.Rate == rateShown {
					series[pr.System] = l.store
					order = append(order, pr.System)
				}
			}
		}
		for _, name := range order {
			pts := cdfPoints(series[name], 400)
			if len(pts) == 0 {
				continue
			}
			line, err := plotter.NewLine(pts)
			if err != nil {
				return err
			}
			line.Color, line.Width = systemColor(name), vg.Points(2)
			lat.Add(line)
			lat.Legend.Add(name, line)
		}
	}

	thr := plot.New()
	thr.Title.Text = fmt.Sprintf("Catch-up: %d-event backlog, events/s", r.catchup.Events)
	thr.Y.Label.Text = "events/s"
	thr.Add(plotter.NewGrid())
	type bar struct {
		name, colour string
		v            float64
	}
	bars := []bar{
		{"walbox", "walbox", rate(r.catchup.Events, r.catchup.Took)},
	}
	if r.perMsg.Events > 0 { // the default is fast batches (issue 36)
		bars[0].name = "walbox\nfast\nbatches"
		bars = append(bars, bar{"walbox\nper\nmessage", "walbox, per message", rate(r.perMsg.Events, r.perMsg.Took)})
	}
	if r.noflag.Events > 0 {
		bars = append(bars, bar{"walbox\nflag off", "walbox, flag off", rate(r.noflag.Events, r.noflag.Took)})
	}
	bars = append(bars,
		bar{"decoding\nceiling", "", rate(r.decode.Events, r.decode.Took)},
		bar{"publishing\nceiling", "", rate(r.publish.Events, r.publish.Took)})
	if r.batchPub.Events > 0 {
		bars = append(bars, bar{"batched\npublishing\nceiling", "", rate(r.batchPub.Events, r.batchPub.Took)})
	}
	if c := r.conc.ceiling(); c > 0 {
		bars = append(bars, bar{"concurrent\nceiling", "", c})
	}
	if c := r.concBatch.ceiling(); c > 0 {
		bars = append(bars, bar{"concurrent\nceiling,\nbatched", "", c})
	}
	for _, pr := range r.peers {
		// One word a line: the bars stand one label's width apart.
		bars = append(bars, bar{strings.ReplaceAll(pr.System, "-", "-\n"), pr.System, rate(pr.Catchup.Events, pr.Catchup.Took)})
	}
	names := make([]string, len(bars))
	for i, b := range bars {
		bc, err := plotter.NewBarChart(plotter.Values{b.v}, vg.Points(36))
		if err != nil {
			return err
		}
		bc.XMin = float64(i)
		bc.Color = systemColor(b.colour)
		bc.LineStyle.Width = 0
		thr.Add(bc)
		names[i] = b.name
	}
	thr.NominalX(names...)
	thr.Y.Min = 0

	const w, h = 14 * vg.Inch, 5.5 * vg.Inch
	img := vgimg.NewWith(vgimg.UseWH(w, h), vgimg.UseDPI(96))
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadTop: vg.Points(8), PadBottom: vg.Points(8),
		PadLeft: vg.Points(8), PadRight: vg.Points(12), PadX: vg.Points(24)}
	canvases := plot.Align([][]*plot.Plot{{lat, thr}}, tiles, dc)
	lat.Draw(canvases[0][0])
	thr.Draw(canvases[0][1])
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// cdfPoints turns sorted latencies into at most n (ms, fraction) points.
func cdfPoints(sorted []time.Duration, n int) plotter.XYs {
	if len(sorted) == 0 {
		return nil
	}
	step := max(1, len(sorted)/n)
	var pts plotter.XYs
	for i := 0; i < len(sorted); i += step {
		pts = append(pts, plotter.XY{X: max(msf(sorted[i]), 0.01), Y: float64(i+1) / float64(len(sorted))})
	}
	last := sorted[len(sorted)-1]
	pts = append(pts, plotter.XY{X: max(msf(last), 0.01), Y: 1})
	return pts
}
