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

/// An SVG: img/s of every measured step over time (left), and each step's phases as stacked
/// bars (right), for a README or a PR.
pub fn svg(steps: &[StepTimes], batch: usize, title: &str) -> String {
    let (w, h, pad) = (900.0, 320.0, 40.0);
    let half = (w - 3.0 * pad) / 2.0;
    let plot_h = h - 2.0 * pad;
    let rates: Vec<f64> = steps
        .iter()
        .map(|s| batch as f64 / s.total().as_secs_f64().max(1e-9))
        .collect();
    let max_rate = rates.iter().cloned().fold(0.0, f64::max).max(1e-9) * 1.1;
    let max_ms = steps
        .iter()
        .map(|s| ms(s.total()))
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    let n = steps.len().max(1) as f64;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{pad}\" y=\"18\" font-size=\"13\">{}</text>\n",
        escape(title)
    );
    // Throughput line.
    let points: Vec<String> = rates
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let x = pad + half * (i as f64 + 0.5) / n;
            let y = pad + plot_h * (1.0 - r / max_rate);
            format!("{x:.1},{y:.1}")
        })
        .collect();
    out += &format!(
        "<text x=\"{pad}\" y=\"{:.0}\">img/s per step (max {:.1})</text>\n\
         <rect x=\"{pad}\" y=\"{pad}\" width=\"{half}\" height=\"{plot_h}\" fill=\"none\" stroke=\"#999\"/>\n\
         <polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n",
        pad - 6.0,
        max_rate / 1.1,
        points.join(" ")
    );
    // Stacked phases per step.
    let x0 = 2.0 * pad + half;
    let bar = half / n;
    out += &format!(
        "<text x=\"{x0}\" y=\"{:.0}\">step breakdown, ms (max {:.0})</text>\n\
         <rect x=\"{x0}\" y=\"{pad}\" width=\"{half}\" height=\"{plot_h}\" fill=\"none\" stroke=\"#999\"/>\n",
        pad - 6.0,
        max_ms / 1.1
    );
    for (i, s) in steps.iter().enumerate() {
        let mut y = pad + plot_h;
        for (p, colour) in Phase::ALL.iter().zip(COLOURS) {
            let hgt = plot_h * ms(s.get(*p)) / max_ms;
            y -= hgt;
            out += &format!(
                "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{hgt:.1}\" fill=\"{colour}\"/>\n",
                x0 + bar * i as f64,
                (bar * 0.9).max(0.5)
            );
        }
    }
    for (k, (p, colour)) in Phase::ALL.iter().zip(COLOURS).enumerate() {
        let x = x0 + k as f64 * half / 5.0;
        out += &format!(
            "<rect x=\"{x:.0}\" y=\"{:.0}\" width=\"10\" height=\"10\" fill=\"{colour}\"/>\
             <text x=\"{:.0}\" y=\"{:.0}\">{}</text>\n",
            h - 22.0,
            x + 13.0,
            h - 13.0,
            p.name()
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
        assert_eq!(svg.matches("<rect").count(), 2 + 10 + 5 + 1);
    }
}
