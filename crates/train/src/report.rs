//! Reports of a run's measured steps: summary figures (DESIGN's img/s definition), JSON, an
//! SVG of throughput over time with the step breakdown, and a Chrome trace (Perfetto) of the
//! phases.

use serde_json::{json, Value};

use crate::timing::{percentile, Phase, StepTimes};

/// What the measured steps add up to.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub steps: usize,
    pub batch: usize,
    /// Batch size ÷ median step time.
    pub images_per_sec: f64,
    pub step_p50_ms: f64,
    pub step_p90_ms: f64,
    /// Median milliseconds of each phase, in [`Phase::ALL`] order.
    pub phase_p50_ms: [f64; 5],
    /// Share of the measured time spent waiting for data (0..1).
    pub data_stall: f64,
    /// Every step's device phases came from device timestamps (else host timers).
    pub device_clock: bool,
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Summary {
    pub fn new(steps: &[StepTimes], batch: usize) -> Self {
        let totals: Vec<f64> = steps.iter().map(|s| ms(s.total())).collect();
        let phase_p50_ms = Phase::ALL.map(|p| {
            let v: Vec<f64> = steps.iter().map(|s| ms(s.get(p))).collect();
            percentile(&v, 50.0)
        });
        let wait: f64 = steps.iter().map(|s| ms(s.get(Phase::DataWait))).sum();
        let all: f64 = totals.iter().sum();
        let p50 = percentile(&totals, 50.0);
        Self {
            steps: steps.len(),
            batch,
            images_per_sec: batch as f64 / (p50 / 1e3),
            step_p50_ms: p50,
            step_p90_ms: percentile(&totals, 90.0),
            phase_p50_ms,
            data_stall: if all > 0.0 { wait / all } else { 0.0 },
            device_clock: !steps.is_empty() && steps.iter().all(|s| s.device_clock),
        }
    }

    pub fn to_json(&self) -> Value {
        let breakdown: serde_json::Map<String, Value> = Phase::ALL
            .iter()
            .zip(self.phase_p50_ms)
            .map(|(p, v)| (p.name().to_string(), json!(v)))
            .collect();
        json!({
            "steps": self.steps,
            "batch": self.batch,
            "images_per_sec": self.images_per_sec,
            "step_p50_ms": self.step_p50_ms,
            "step_p90_ms": self.step_p90_ms,
            "breakdown_p50_ms": breakdown,
            "data_stall": self.data_stall,
            "phase_clock": if self.device_clock {
                "device timestamps"
            } else {
                "host timer after synchronising"
            },
        })
    }
}

const COLOURS: [&str; 5] = ["#d62728", "#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd"];

/// Round tick values from 0: steps of 1, 2 or 5 × 10^k, about `count` of them, the last at or
/// above `max` (a non-positive or non-finite `max` gets the ticks of 1).
fn ticks(max: f64, count: usize) -> Vec<f64> {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / count.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * magnitude);
    let n = (max / step - 1e-9).ceil().max(1.0) as usize;
    (0..=n).map(|i| i as f64 * step).collect()
}

/// A tick's label: as few decimals as the tick step needs.
fn tick_label(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 {
        0
    } else {
        (-step.log10()).ceil() as usize
    };
    format!("{v:.decimals$}")
}

/// Approximate width in pixels of `text` at the charts' 11 px sans-serif.
fn text_width(text: &str) -> f64 {
    text.chars().count() as f64 * 6.2
}

/// A chart's plot area: steps along x (1..=n, one slot each), values along y from 0.
struct Panel {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
    n: usize,
    y_ticks: Vec<f64>,
}

impl Panel {
    fn top(&self) -> f64 {
        self.y_ticks.last().copied().unwrap_or(1.0)
    }

    /// The x of step `i`'s slot centre (0-based).
    fn px(&self, i: usize) -> f64 {
        self.x + self.w * (i as f64 + 0.5) / self.n.max(1) as f64
    }

    fn py(&self, v: f64) -> f64 {
        self.y + self.h * (1.0 - v / self.top())
    }

    /// Frame, grid lines, tick labels on both axes and the axis titles.
    fn axes(&self, title: &str, y_title: &str) -> String {
        let (x, y, w, h) = (self.x, self.y, self.w, self.h);
        let mut out = format!(
            "<text x=\"{x:.0}\" y=\"{:.0}\" font-size=\"12\">{}</text>\n",
            y - 10.0,
            escape(title)
        );
        let step = self.y_ticks.get(1).copied().unwrap_or(1.0);
        for &v in &self.y_ticks {
            let ty = self.py(v);
            out += &format!(
                "<line x1=\"{x:.1}\" y1=\"{ty:.1}\" x2=\"{:.1}\" y2=\"{ty:.1}\" stroke=\"#e4e4e4\"/>\n\
                 <line x1=\"{:.1}\" y1=\"{ty:.1}\" x2=\"{x:.1}\" y2=\"{ty:.1}\" stroke=\"#555\"/>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
                x + w,
                x - 4.0,
                x - 6.0,
                ty + 4.0,
                tick_label(v, step)
            );
        }
        // Step numbers: 1 and about six round values after it.
        let every = ticks(self.n as f64, 6)
            .get(1)
            .copied()
            .unwrap_or(1.0)
            .max(1.0) as usize;
        let mut labelled: Vec<usize> = (0..=self.n).step_by(every).filter(|&k| k >= 1).collect();
        if labelled.first() != Some(&1) {
            labelled.insert(0, 1);
        }
        for k in labelled {
            let tx = self.px(k - 1);
            out += &format!(
                "<line x1=\"{tx:.1}\" y1=\"{:.1}\" x2=\"{tx:.1}\" y2=\"{:.1}\" stroke=\"#555\"/>\n\
                 <text x=\"{tx:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{k}</text>\n",
                y + h,
                y + h + 4.0,
                y + h + 16.0
            );
        }
        out += &format!(
            "<rect x=\"{x:.1}\" y=\"{y:.1}\" width=\"{w:.1}\" height=\"{h:.1}\" fill=\"none\" stroke=\"#555\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">measured step</text>\n\
             <text transform=\"translate({:.1},{:.1}) rotate(-90)\" text-anchor=\"middle\">{}</text>\n",
            x + w / 2.0,
            y + h + 32.0,
            x - 40.0,
            y + h / 2.0,
            escape(y_title)
        );
        out
    }
}

/// Where each legend entry (a 10 px swatch and its label) goes: left to right from `x`,
/// wrapping onto a new row 16 px lower when the next would pass `x + width`; never overlapping.
fn legend_layout(labels: &[&str], x: f64, y: f64, width: f64) -> Vec<(f64, f64)> {
    let mut at = (x, y);
    labels
        .iter()
        .map(|label| {
            let item = 14.0 + text_width(label) + 16.0;
            if at.0 > x && at.0 + item > x + width {
                at = (x, at.1 + 16.0);
            }
            let here = at;
            at.0 += item;
            here
        })
        .collect()
}

/// An SVG: img/s of every measured step (left), and each step's phases as stacked bars in ms
/// (right), with ticked, labelled axes, for a README or a PR.
pub fn svg(steps: &[StepTimes], batch: usize, title: &str) -> String {
    let (w, h) = (960.0, 380.0);
    let (left, top, gap, panel_w, panel_h) = (62.0, 58.0, 80.0, 380.0, 240.0);
    let rates: Vec<f64> = steps
        .iter()
        .map(|s| batch as f64 / s.total().as_secs_f64().max(1e-9))
        .collect();
    let max_rate = rates.iter().cloned().fold(0.0, f64::max);
    let max_ms = steps.iter().map(|s| ms(s.total())).fold(0.0, f64::max);
    let n = steps.len().max(1);
    let throughput = Panel {
        x: left,
        y: top,
        w: panel_w,
        h: panel_h,
        n,
        y_ticks: ticks(max_rate, 5),
    };
    let breakdown = Panel {
        x: left + panel_w + gap,
        y: top,
        w: panel_w,
        h: panel_h,
        n,
        y_ticks: ticks(max_ms, 5),
    };
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"22\" font-size=\"14\">{}</text>\n",
        escape(title)
    );
    out += &throughput.axes("Throughput of each step", "img/s");
    let points: Vec<String> = rates
        .iter()
        .enumerate()
        .map(|(i, r)| format!("{:.1},{:.1}", throughput.px(i), throughput.py(*r)))
        .collect();
    out += &format!(
        "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n",
        points.join(" ")
    );
    out += &breakdown.axes("Where each step's time went", "ms per step");
    let slot = breakdown.w / n as f64;
    for (i, s) in steps.iter().enumerate() {
        let mut v = 0.0;
        for (p, colour) in Phase::ALL.iter().zip(COLOURS) {
            let (from, to) = (v, v + ms(s.get(*p)));
            v = to;
            out += &format!(
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{colour}\"/>\n",
                breakdown.px(i) - slot * 0.45,
                breakdown.py(to),
                (slot * 0.9).max(0.5),
                breakdown.py(from) - breakdown.py(to)
            );
        }
    }
    let names: Vec<&str> = Phase::ALL.iter().map(|p| p.name()).collect();
    let legend_y = top + panel_h + 50.0;
    for ((name, colour), (lx, ly)) in
        names
            .iter()
            .zip(COLOURS)
            .zip(legend_layout(&names, breakdown.x, legend_y, breakdown.w))
    {
        out += &format!(
            "<rect x=\"{lx:.1}\" y=\"{:.1}\" width=\"10\" height=\"10\" fill=\"{colour}\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\">{name}</text>\n",
            ly - 9.0,
            lx + 14.0,
            ly
        );
    }
    out + "</svg>\n"
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A Chrome trace (`chrome://tracing`, ui.perfetto.dev) of `steps`: one slice per phase, laid
/// end to end on one track, plus one slice per step on a second track.
pub fn chrome_trace(steps: &[StepTimes]) -> Value {
    let mut events = Vec::new();
    let mut t = 0.0f64;
    for (i, s) in steps.iter().enumerate() {
        let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
        events.push(json!({
            "name": format!("step {i}"), "ph": "X", "pid": 1, "tid": 1,
            "ts": t, "dur": us(s.total()),
        }));
        let mut at = t;
        for p in Phase::ALL {
            events.push(json!({
                "name": p.name(), "ph": "X", "pid": 1, "tid": 2, "ts": at, "dur": us(s.get(p)),
            }));
            at += us(s.get(p));
        }
        t = at;
    }
    json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn step(ms: [u64; 5]) -> StepTimes {
        StepTimes {
            phases: ms.map(Duration::from_millis),
            device_clock: false,
        }
    }

    #[test]
    fn summary_uses_the_median_step_and_sums_the_stall() {
        let steps = [
            step([10, 5, 30, 50, 5]),  // 100 ms
            step([0, 5, 30, 60, 5]),   // 100 ms
            step([100, 5, 30, 60, 5]), // 200 ms
        ];
        let s = Summary::new(&steps, 8);
        assert_eq!(s.step_p50_ms, 100.0);
        assert!((s.images_per_sec - 80.0).abs() < 1e-9);
        assert!((s.data_stall - 110.0 / 400.0).abs() < 1e-12);
        assert_eq!(s.phase_p50_ms, [10.0, 5.0, 30.0, 60.0, 5.0]);
        let j = s.to_json();
        assert_eq!(j["breakdown_p50_ms"]["backward"], 60.0);
        assert_eq!(j["phase_clock"], "host timer after synchronising");
        let timed = steps.map(|s| StepTimes {
            device_clock: true,
            ..s
        });
        assert_eq!(
            Summary::new(&timed, 8).to_json()["phase_clock"],
            "device timestamps"
        );
    }

    #[test]
    fn trace_slices_tile_each_step() {
        let steps = [step([1, 2, 3, 4, 5]), step([5, 4, 3, 2, 1])];
        let t = chrome_trace(&steps);
        let events = t["traceEvents"].as_array().unwrap();
        assert_eq!(events.len(), 12);
        assert_eq!(events[6]["name"], "step 1");
        assert_eq!(
            events[6]["ts"], 15_000.0,
            "step 1 starts where step 0's phases end"
        );
        let svg = svg(&steps, 8, "a <test>");
        assert!(svg.starts_with("<svg") && svg.contains("a &lt;test&gt;"));
        // Background, two frames, 2 × 5 phase bars, 5 legend swatches.
        assert_eq!(svg.matches("<rect").count(), 1 + 2 + 10 + 5);
        // Units on both value axes, a step axis, and tick labels (15 ms steps → 0, 5, 10, 15 ms).
        for text in [">img/s<", ">ms per step<", ">measured step<", ">15<", ">0<"] {
            assert!(svg.contains(text), "{text} missing");
        }
    }

    #[test]
    fn ticks_are_round_and_reach_the_maximum() {
        assert_eq!(ticks(6.61, 5), [0.0, 2.0, 4.0, 6.0, 8.0]);
        assert_eq!(ticks(1211.0, 5), [0.0, 500.0, 1000.0, 1500.0]);
        assert_eq!(ticks(0.37, 4), [0.0, 0.1, 0.2, 0.30000000000000004, 0.4]);
        assert_eq!(ticks(10.0, 5), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(0.0, 5), [0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]);
        assert_eq!(tick_label(0.30000000000000004, 0.1), "0.3");
        assert_eq!(tick_label(1500.0, 500.0), "1500");
    }

    #[test]
    fn legend_entries_never_overlap_and_wrap_inside_the_panel() {
        let names: Vec<&str> = Phase::ALL.iter().map(|p| p.name()).collect();
        for width in [120.0, 380.0, 2000.0] {
            let at = legend_layout(&names, 10.0, 100.0, width);
            for (i, (a, name)) in at.iter().zip(&names).enumerate() {
                let end = a.0 + 14.0 + text_width(name);
                assert!(end <= 10.0 + width.max(14.0 + text_width(name)) + 1e-9);
                for b in &at[i + 1..] {
                    let same_row = (a.1 - b.1).abs() < 1e-9;
                    assert!(!same_row || b.0 >= end, "{name} overlaps the next entry");
                }
            }
        }
    }
}
