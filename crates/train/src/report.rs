//! Reports of a run's measured steps: summary figures (DESIGN's img/s definition), JSON, and a
//! Chrome trace (Perfetto) of the phases. The SVG charts are in `chart.rs`.

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
    /// The mean step: per-step totals (an op profile's) divide into it.
    pub step_mean_ms: f64,
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
            step_mean_ms: all / steps.len().max(1) as f64,
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
            "step_mean_ms": self.step_mean_ms,
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

    #[test]
    fn summary_uses_the_median_step_and_sums_the_stall() {
        let steps = [
            StepTimes::from_ms([10, 5, 30, 50, 5]),  // 100 ms
            StepTimes::from_ms([0, 5, 30, 60, 5]),   // 100 ms
            StepTimes::from_ms([100, 5, 30, 60, 5]), // 200 ms
        ];
        let s = Summary::new(&steps, 8);
        assert_eq!(s.step_p50_ms, 100.0);
        assert!((s.step_mean_ms - 400.0 / 3.0).abs() < 1e-9);
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
        let steps = [
            StepTimes::from_ms([1, 2, 3, 4, 5]),
            StepTimes::from_ms([5, 4, 3, 2, 1]),
        ];
        let t = chrome_trace(&steps);
        let events = t["traceEvents"].as_array().unwrap();
        assert_eq!(events.len(), 12);
        assert_eq!(events[6]["name"], "step 1");
        assert_eq!(
            events[6]["ts"], 15_000.0,
            "step 1 starts where step 0's phases end"
        );
    }
}
