//! `cargo xtask doctor`: reads a run's report (bench-imagenet's JSON, or redline-train's with
//! its per-epoch step summaries) and says which of the four reasons a GPU idles holds — the
//! loader cannot keep up, too many short kernels issued by a host that cannot keep up, slow
//! memory access in the memory-bound ops, synchronisations that stall the queue — with the
//! evidence from the report and the fix. A reason the report has no evidence for is said to be
//! "not measured", with what to run to measure it, never guessed.
//!
//! The thresholds are where a reason costs a visible share of the step:
//! * data: the step waited for data more than [`DATA_STALL`] of the time (the project's goal
//!   for a fed GPU is under 2%);
//! * launches (asynchronous devices only): the host spent at least [`HOST_BOUND`] of the device
//!   part of the step issuing work, and the device was busy less than [`BUSY`] of it;
//! * memory access: memory-bound ops took at least [`MEMORY_SHARE`] of the device part of the
//!   step at under [`BANDWIDTH_SHARE`] of the device's stream bandwidth (as its own copy and
//!   negation reach it);
//! * synchronisation (asynchronous devices only): the host waited at least [`BLOCKED`] of the
//!   step for the device, while the device was busy less than [`BUSY`] of it.

use std::fmt;

use serde_json::{json, Value};

mod gpu_check;

pub use gpu_check::merge as merge_gpu_checks;

pub const DATA_STALL: f64 = 0.02;
pub const HOST_BOUND: f64 = 0.5;
pub const BUSY: f64 = 0.85;
pub const MEMORY_SHARE: f64 = 0.15;
pub const BANDWIDTH_SHARE: f64 = 0.5;
pub const BLOCKED: f64 = 0.1;

/// The four reasons a GPU idles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bottleneck {
    Data,
    Launches,
    MemoryAccess,
    Synchronisation,
}

impl Bottleneck {
    pub fn name(self) -> &'static str {
        match self {
            Bottleneck::Data => "data loading",
            Bottleneck::Launches => "many short kernels, host-bound",
            Bottleneck::MemoryAccess => "memory access",
            Bottleneck::Synchronisation => "synchronisation",
        }
    }
}

/// What the report says of one reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Holds,
    Clear,
    /// The reason cannot arise on this device (a synchronous one has no queue to starve).
    NotApplicable,
    /// The report lacks the evidence.
    NotMeasured,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Holds => "holds",
            Status::Clear => "clear",
            Status::NotApplicable => "n/a",
            Status::NotMeasured => "not measured",
        }
    }
}

/// One reason, judged.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub bottleneck: Bottleneck,
    pub status: Status,
    /// The share of the step the reason accounts for, where measured.
    pub share: Option<f64>,
    pub evidence: String,
    /// What to do (empty unless it holds).
    pub fix: String,
}

/// The doctor's answer for one report.
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnosis {
    /// What ran: model, resolution, batch, precision, device, speed.
    pub subject: String,
    /// The four reasons in [`Bottleneck`] order.
    pub findings: Vec<Finding>,
    pub verdict: String,
}

impl Diagnosis {
    /// The reasons that hold, the largest share first.
    pub fn holding(&self) -> Vec<&Finding> {
        let mut v: Vec<&Finding> = (self.findings.iter())
            .filter(|f| f.status == Status::Holds)
            .collect();
        v.sort_by(|a, b| b.share.unwrap_or(0.0).total_cmp(&a.share.unwrap_or(0.0)));
        v
    }

    pub fn finding(&self, b: Bottleneck) -> &Finding {
        // Every diagnosis judges all four, in order.
        &self.findings[b as usize]
    }

    pub fn to_json(&self) -> Value {
        let findings: Vec<Value> = (self.findings.iter())
            .map(|f| {
                json!({
                    "bottleneck": f.bottleneck.name(), "status": f.status.name(),
                    "share": f.share, "evidence": f.evidence, "fix": f.fix,
                })
            })
            .collect();
        json!({ "subject": self.subject, "findings": findings, "verdict": self.verdict })
    }
}

impl fmt::Display for Diagnosis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.subject)?;
        for finding in &self.findings {
            let status = format!("[{}]", finding.status.name());
            writeln!(
                f,
                "  {status:<15}{}: {}",
                finding.bottleneck.name(),
                finding.evidence
            )?;
            if !finding.fix.is_empty() {
                writeln!(f, "  {:<15}fix: {}", "", finding.fix)?;
            }
        }
        write!(f, "verdict: {}", self.verdict)
    }
}

/// A report the doctor cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotAReport(String);

/// The figures the doctor needs, taken from a report.
struct Evidence {
    step_ms: f64,
    stall: f64,
    synchronous: bool,
    ops: Option<Ops>,
    stream_gb_per_s: Option<f64>,
    /// Device allocations per measured step (devices with a caching allocator).
    allocations_per_step: Option<f64>,
    /// Nodes of the graph the measured steps replayed (the report's `graph`, when active).
    graph_nodes: Option<f64>,
}

struct Ops {
    device_timed: bool,
    launches: f64,
    host_issue_ms: f64,
    blocked_ms: f64,
    /// (call, calls per step, ms per step), the longest first.
    blocking: Vec<(String, f64, f64)>,
    device_ms: Option<f64>,
    memory_ms: f64,
    memory_bytes: f64,
    /// Memory-bound rows (detail only): (label, ms per step, bytes per step), slowest first.
    memory_rows: Vec<(String, f64, f64)>,
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

fn text(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_string)
}

impl Ops {
    fn read(ops: &Value) -> Option<Self> {
        let kinds = ops.get("by_kind")?;
        let memory = ["elementwise", "reduction"].map(|k| &kinds[k]);
        let sum = |key: &str| memory.iter().filter_map(|k| num(k, key)).sum::<f64>();
        let mut blocking: Vec<(String, f64, f64)> = (ops.get("blocking_calls"))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|b| {
                Some((
                    text(b, "call")?,
                    num(b, "calls_per_step")?,
                    num(b, "ms_per_step")?,
                ))
            })
            .collect();
        blocking.sort_by(|a, b| b.2.total_cmp(&a.2));
        let mut memory_rows: Vec<(String, f64, f64)> = (ops.get("rows"))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|r| matches!(r["kind"].as_str(), Some("elementwise" | "reduction")))
            .filter_map(|r| {
                Some((
                    text(r, "op")?,
                    num(r, "ms_per_step")?,
                    num(r, "bytes_per_step")?,
                ))
            })
            .collect();
        memory_rows.sort_by(|a, b| b.1.total_cmp(&a.1));
        Some(Ops {
            device_timed: text(ops, "clock").as_deref() == Some("device timestamps"),
            launches: num(ops, "launches_per_step")?,
            host_issue_ms: num(ops, "host_issue_ms_per_step")?,
            blocked_ms: num(ops, "blocked_ms_per_step")?,
            blocking,
            device_ms: num(ops, "device_ms_per_step"),
            memory_ms: sum("ms_per_step"),
            memory_bytes: sum("bytes_per_step"),
            memory_rows,
        })
    }
}

/// The step figures of a bench report, or of a training report's last epoch.
fn steps_of(report: &Value) -> Result<&Value, NotAReport> {
    if report.get("images_per_sec").is_some() {
        return Ok(report);
    }
    if let Some(history) = report.get("history").and_then(Value::as_array) {
        return (history.iter().rev())
            .find_map(|epoch| epoch.get("steps"))
            .ok_or_else(|| {
                NotAReport(
                    "a training report without step summaries (written before redline-train \
                     recorded them): rerun the training or run `cargo xtask doctor --run`"
                        .into(),
                )
            });
    }
    Err(NotAReport(
        "neither a bench report (images_per_sec) nor a training report (history)".into(),
    ))
}

/// GB/s with three significant digits or one decimal (a software adapter runs at MB/s).
fn rate(gb_per_s: f64) -> String {
    if gb_per_s < 1.0 {
        format!("{gb_per_s:.3} GB/s")
    } else {
        format!("{gb_per_s:.1} GB/s")
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// Judges `report` (a bench-imagenet, redline-train or redline-gpu-check JSON).
pub fn diagnose(report: &Value) -> Result<Diagnosis, NotAReport> {
    if let Some(stages) = report.get("stages").and_then(Value::as_array) {
        return gpu_check::diagnose(report, stages);
    }
    let steps = steps_of(report)?;
    let field = |v: &Value, key: &str| num(v, key).or_else(|| num(report, key));
    let step_ms = (field(steps, "step_mean_ms").or_else(|| field(steps, "step_p50_ms")))
        .ok_or_else(|| NotAReport("the report has no step time".into()))?;
    let stall = field(steps, "data_stall")
        .ok_or_else(|| NotAReport("the report has no data_stall".into()))?;
    let ops = steps.get("ops").or_else(|| report.get("ops"));
    let clock = ops.and_then(|o| text(o, "clock")).unwrap_or_default();
    let kind = text(report, "device_kind").unwrap_or_default();
    let evidence = Evidence {
        step_ms,
        stall,
        synchronous: clock.contains("synchronously") || kind == "cpu",
        ops: ops.and_then(Ops::read),
        stream_gb_per_s: field(steps, "stream_gb_per_s"),
        allocations_per_step: allocations_per_step(steps, report),
        graph_nodes: report
            .get("graph")
            .filter(|g| g.get("active").and_then(Value::as_bool) == Some(true))
            .and_then(|g| num(g, "nodes")),
    };
    let findings = vec![
        data(&evidence, report),
        launches(&evidence),
        memory(&evidence),
        synchronisation(&evidence),
    ];
    let subject = format!(
        "{} at {}px, batch {}, {} on {}: {:.2} img/s, {:.1} ms a step",
        text(report, "model").unwrap_or_else(|| "a model".into()),
        field(steps, "resolution").unwrap_or(f64::NAN),
        field(steps, "batch").unwrap_or(f64::NAN),
        text(report, "precision").unwrap_or_else(|| "?".into()),
        text(report, "device").unwrap_or_else(|| "a device".into()),
        field(steps, "images_per_sec")
            .or_else(|| field(steps, "train_images_per_sec"))
            .unwrap_or(f64::NAN),
        step_ms,
    );
    let mut diagnosis = Diagnosis {
        subject,
        findings,
        verdict: String::new(),
    };
    diagnosis.verdict = verdict(&diagnosis, &evidence, report);
    Ok(diagnosis)
}

/// Device allocations per step over the steps the report's `device_memory` section counted.
fn allocations_per_step(steps: &Value, report: &Value) -> Option<f64> {
    let m = steps
        .get("device_memory")
        .or_else(|| report.get("device_memory"))?;
    Some(num(m, "device_allocations_measured")? / num(m, "steps")?.max(1.0))
}

/// The reasons that hold, the largest first, and the first one's fix (`None`: none holds).
fn holding_verdict(d: &Diagnosis) -> Option<String> {
    let holding = d.holding();
    let first = holding.first()?;
    let names: Vec<&str> = holding.iter().map(|f| f.bottleneck.name()).collect();
    Some(format!(
        "{} ({}); fix it first: {}",
        names.join(", then "),
        first.share.map_or_else(
            || "share not measured".into(),
            |s| { format!("{} of the step", pct(s)) }
        ),
        first.fix
    ))
}

fn verdict(d: &Diagnosis, e: &Evidence, report: &Value) -> String {
    if let Some(v) = holding_verdict(d) {
        return v;
    }
    let unmeasured = (d.findings.iter()).any(|f| f.status == Status::NotMeasured);
    let busy = (e.ops.as_ref())
        .and_then(|o| o.device_ms)
        .map(|ms| ms / (e.step_ms * (1.0 - e.stall)));
    let speed = num(report, "achieved_gflops")
        .map(|g| format!(" at {g:.1} GFLOP/s"))
        .unwrap_or_default();
    match (unmeasured, busy) {
        (true, _) => "none of the measured reasons holds; rerun with --profile-ops (device \
                      timing per op) to judge the rest"
            .into(),
        (false, Some(b)) => format!(
            "none of the four holds: the device is busy {} of the step{speed} — the kernels \
             themselves are what is left to speed up",
            pct(b.min(1.0))
        ),
        (false, None) => format!("none of the four holds{speed}"),
    }
}

fn data(e: &Evidence, report: &Value) -> Finding {
    let workers = num(report, "workers");
    let decoder = text(report, "decoder");
    let evidence = format!(
        "the step waited for data {} of the time ({:.1} ms of {:.1} ms a step), {} loader \
         threads, {} decoder",
        pct(e.stall),
        e.stall * e.step_ms,
        e.step_ms,
        workers.map_or_else(|| "?".into(), |w| format!("{w}")),
        decoder.as_deref().unwrap_or("?"),
    );
    data_finding(e.stall > DATA_STALL, e.stall, evidence, decoder.as_deref())
}

/// The data finding: the loader's fixes when it `holds` (libjpeg-turbo's where `decoder` is
/// another).
fn data_finding(holds: bool, stall: f64, evidence: String, decoder: Option<&str>) -> Finding {
    let mut fixes = vec!["more loader workers (the loader scales with cores)".to_string()];
    if decoder.is_some_and(|d| !d.contains("turbo")) {
        fixes.push("libjpeg-turbo's DCT-scaled decodes (build with cmake and nasm present)".into());
    }
    fixes.push("a lower training resolution or smaller stored images (shards at ~256 px)".into());
    Finding {
        bottleneck: Bottleneck::Data,
        status: if holds { Status::Holds } else { Status::Clear },
        share: Some(stall),
        evidence,
        fix: if holds {
            fixes.join("; ")
        } else {
            String::new()
        },
    }
}

/// The device part of a step (what is not waiting for data), in ms.
fn device_part(e: &Evidence) -> f64 {
    (e.step_ms * (1.0 - e.stall)).max(f64::MIN_POSITIVE)
}

fn busy_text(busy: Option<f64>) -> String {
    busy.map_or_else(
        || "device time not measured".into(),
        |b| format!("device busy {} of it", pct(b.min(1.0))),
    )
}

fn not_measured(bottleneck: Bottleneck, evidence: &str) -> Finding {
    Finding {
        bottleneck,
        status: Status::NotMeasured,
        share: None,
        evidence: evidence.into(),
        fix: String::new(),
    }
}

const NO_OPS: &str = "the report has no op counts (a report from before they were kept): \
                      rerun the bench, or `cargo xtask doctor --run`";

fn launches(e: &Evidence) -> Finding {
    let b = Bottleneck::Launches;
    let Some(ops) = &e.ops else {
        return not_measured(b, NO_OPS);
    };
    if e.synchronous {
        return Finding {
            bottleneck: b,
            status: Status::NotApplicable,
            share: None,
            evidence: format!(
                "{:.0} ops a step run synchronously on this device: the host's time in them is \
                 the work itself, with no queue for the device to run dry",
                ops.launches
            ),
            fix: String::new(),
        };
    }
    let part = device_part(e);
    let share = ops.host_issue_ms / part;
    let busy = ops.device_ms.map(|d| d / part);
    let holds = share >= HOST_BOUND && busy.is_none_or(|b| b < BUSY);
    let evidence = format!(
        "{:.0} launches a step; the host spent {:.1} ms issuing them ({:.1} µs each), {} of \
         the device part of the step; {}",
        ops.launches,
        ops.host_issue_ms,
        1e3 * ops.host_issue_ms / ops.launches.max(1.0),
        pct(share),
        busy_text(busy)
    );
    Finding {
        bottleneck: b,
        status: if holds { Status::Holds } else { Status::Clear },
        share: Some(share.min(1.0)),
        evidence,
        fix: match (holds, e.graph_nodes) {
            (false, _) => String::new(),
            (true, None) => "replay the step as a captured CUDA graph (`--graph` on `cargo xtask \
                 bench imagenet`, `Trainer::with_graph`: one launch a step once shapes are \
                 static); fuse short kernels (batch norm + ReLU + residual, the optimizer and \
                 the finite check as single multi-tensor launches)"
                .into(),
            (true, Some(nodes)) => format!(
                "the step already replays a graph of {nodes:.0} nodes, so the launch count \
                 above is the capture's: fuse short kernels to shrink the graph, and check \
                 what runs outside it (the report's graph.eager_steps_after_warmup)"
            ),
        },
    }
}

fn memory(e: &Evidence) -> Finding {
    let b = Bottleneck::MemoryAccess;
    let Some(ops) = &e.ops else {
        return not_measured(b, NO_OPS);
    };
    if !(ops.device_timed || e.synchronous) {
        return not_measured(
            b,
            "the memory-bound ops' time was taken on the host, which on this device only times \
             their enqueueing: rerun with --profile-ops for device time per op",
        );
    }
    let Some(peak) = e.stream_gb_per_s else {
        return not_measured(b, "the report has no stream bandwidth to compare with");
    };
    let share = ops.memory_ms / device_part(e);
    let gbs = |bytes: f64, ms: f64| bytes / ms.max(1e-9) / 1e6;
    let achieved = gbs(ops.memory_bytes, ops.memory_ms);
    let slowest: Vec<String> = (ops.memory_rows.iter().take(3))
        .map(|(op, ms, bytes)| format!("{op} {ms:.2} ms at {}", rate(gbs(*bytes, *ms))))
        .collect();
    let holds = share >= MEMORY_SHARE && achieved < BANDWIDTH_SHARE * peak;
    let versus = if achieved > peak {
        format!(
            "above this device's stream bandwidth ({}): their working set stays in cache",
            rate(peak)
        )
    } else {
        format!(
            "{} of this device's stream bandwidth ({})",
            pct(achieved / peak),
            rate(peak)
        )
    };
    let mut evidence = format!(
        "elementwise and reduction ops took {:.1} ms a step ({} of the device part), moving \
         {:.1} MB at {} — {versus}",
        ops.memory_ms,
        pct(share),
        ops.memory_bytes / 1e6,
        rate(achieved),
    );
    if !slowest.is_empty() {
        evidence += &format!("; slowest: {}", slowest.join(", "));
    }
    Finding {
        bottleneck: b,
        status: if holds { Status::Holds } else { Status::Clear },
        share: Some(share.min(1.0)),
        evidence,
        fix: if holds {
            "layout and fusion: one layout end to end (NHWC under AMP) so no op converts or \
             reads strided, elementwise chains fused so each element is read once (batch norm \
             + ReLU + residual), 128-bit vectorised loads in the kernels"
                .into()
        } else {
            String::new()
        },
    }
}

/// What a blocking call found in a step is, and how to get rid of it.
fn explain(call: &str) -> &'static str {
    match call {
        "read_timestamps" => {
            "the phase clock reads each step's device timestamps when the step ends, so the \
             host never runs ahead: read them a few steps late from a ring of slots"
        }
        "download" => {
            "a blocking read of a device value each step (the loss's item()): read it \
             asynchronously, a few steps late"
        }
        "synchronize" => "an explicit device synchronisation each step: drop it",
        _ => "a call that waits for the device: move it out of the step",
    }
}

fn synchronisation(e: &Evidence) -> Finding {
    let b = Bottleneck::Synchronisation;
    let Some(ops) = &e.ops else {
        return not_measured(b, NO_OPS);
    };
    let part = device_part(e);
    let share = ops.blocked_ms / part;
    let calls: Vec<String> = (ops.blocking.iter())
        .map(|(call, n, ms)| format!("{call} ×{n:.1} ({ms:.1} ms)"))
        .collect();
    let calls = if calls.is_empty() {
        "no blocking calls".to_string()
    } else {
        calls.join(", ")
    };
    if e.synchronous {
        return Finding {
            bottleneck: b,
            status: Status::NotApplicable,
            share: None,
            evidence: format!(
                "ops run synchronously on this device, so waiting for it costs nothing ({calls} \
                 a step)"
            ),
            fix: String::new(),
        };
    }
    let busy = ops.device_ms.map(|d| d / part);
    let mut evidence = format!(
        "the host waited for the device {:.1} ms a step ({} of the device part): {calls}; {}",
        ops.blocked_ms,
        pct(share),
        busy_text(busy)
    );
    // cudaMalloc and cudaFree can synchronise the device: a steady state takes none.
    let allocating = e.allocations_per_step.filter(|&a| a >= 1.0);
    if let Some(a) = allocating {
        evidence += &format!("; {a:.1} device allocations a step while measuring");
    }
    let waits = match busy {
        Some(busy) => share >= BLOCKED && busy < BUSY,
        None if allocating.is_none() => {
            return Finding {
                status: if share >= BLOCKED {
                    Status::NotMeasured
                } else {
                    Status::Clear
                },
                ..not_measured(
                    b,
                    &format!("{evidence}; whether the device idled meanwhile needs --profile-ops"),
                )
            };
        }
        None => false,
    };
    let holds = waits || allocating.is_some();
    let fix = match (waits, ops.blocking.first(), allocating) {
        (true, Some((call, _, _)), _) => format!("{call}: {}", explain(call)),
        (_, _, Some(_)) => "device allocations in the steady state: serve every step from the \
                            caching allocator (static shapes, a higher cap)"
            .into(),
        _ => String::new(),
    };
    Finding {
        bottleneck: b,
        status: if holds { Status::Holds } else { Status::Clear },
        share: Some(share.min(1.0)),
        evidence,
        fix,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bench report with the given step figures and ops section.
    fn report(kind: &str, stall: f64, ops: Value) -> Value {
        json!({
            "images_per_sec": 100.0, "step_mean_ms": 100.0, "step_p50_ms": 100.0,
            "data_stall": stall, "batch": 32, "resolution": 224, "model": "resnet50",
            "precision": "bf16", "device": format!("{kind}:0"), "device_kind": kind,
            "workers": 4, "decoder": "zune-jpeg (pure Rust)", "stream_gb_per_s": 1000.0,
            "achieved_gflops": 1234.5, "ops": ops,
        })
    }

    /// An ops section: launches, host issue ms, blocking calls, device ms, memory-bound ms
    /// and bytes.
    fn ops(
        clock: &str,
        launches: f64,
        host_ms: f64,
        blocking: &[(&str, f64, f64)],
        device_ms: Option<f64>,
        memory: (f64, f64),
    ) -> Value {
        let blocked: f64 = blocking.iter().map(|b| b.2).sum();
        let calls: Vec<Value> = (blocking.iter())
            .map(|(c, n, ms)| json!({"call": c, "calls_per_step": n, "ms_per_step": ms}))
            .collect();
        json!({
            "clock": clock, "launches_per_step": launches, "host_issue_ms_per_step": host_ms,
            "blocked_ms_per_step": blocked, "blocking_calls": calls,
            "device_ms_per_step": device_ms,
            "by_kind": {
                "elementwise": {"calls_per_step": 100, "ms_per_step": memory.0 / 2.0,
                                "bytes_per_step": memory.1 / 2.0},
                "reduction": {"calls_per_step": 50, "ms_per_step": memory.0 / 2.0,
                              "bytes_per_step": memory.1 / 2.0},
            },
        })
    }

    const DEVICE: &str = "device timestamps";

    fn holding(d: &Diagnosis) -> Vec<Bottleneck> {
        d.holding().iter().map(|f| f.bottleneck).collect()
    }

    #[test]
    fn a_starved_loader_is_named_with_its_fix() {
        // 30% of the step waiting for data; the device is busy the rest of the time.
        let ops = ops(DEVICE, 300.0, 5.0, &[], Some(68.0), (5.0, 4e9));
        let d = diagnose(&report("cuda", 0.3, ops)).unwrap();
        assert_eq!(holding(&d), [Bottleneck::Data]);
        let f = d.finding(Bottleneck::Data);
        assert!(f.evidence.contains("30.0%") && f.evidence.contains("4 loader threads"));
        assert!(f.fix.contains("more loader workers") && f.fix.contains("DCT-scaled"));
        assert!(d.verdict.starts_with("data loading (30.0% of the step)"));
        assert!(d.to_string().contains("[holds]"), "{d}");
    }

    #[test]
    fn a_host_bound_step_of_short_kernels_asks_for_a_graph() {
        // 1,200 launches at 60 µs of host time each = 72 ms of a 100 ms step, device busy 30%.
        let ops = ops(DEVICE, 1200.0, 72.0, &[], Some(30.0), (5.0, 4e9));
        let d = diagnose(&report("cuda", 0.0, ops.clone())).unwrap();
        assert_eq!(holding(&d), [Bottleneck::Launches]);
        let f = d.finding(Bottleneck::Launches);
        assert!(f.evidence.contains("1200 launches") && f.evidence.contains("60.0 µs each"));
        assert!(f.evidence.contains("device busy 30.0%"), "{}", f.evidence);
        assert!(
            f.fix.contains("CUDA graph") && f.fix.contains("--graph"),
            "{}",
            f.fix
        );
        // A run that already replays a graph is told to shrink it instead: the `graph` as
        // bench and train reports write it.
        let mut r = report("cuda", 0.0, ops);
        let stats = crate::GraphStats {
            requested: true,
            nodes: 900,
            replays: 40,
            captures: 1,
            ..Default::default()
        };
        r["graph"] = stats.to_json();
        let d = diagnose(&r).unwrap();
        let f = d.finding(Bottleneck::Launches);
        assert!(
            f.fix.contains("already replays a graph of 900 nodes"),
            "{}",
            f.fix
        );
    }

    #[test]
    fn slow_memory_bound_ops_ask_for_layout_and_fusion() {
        // 40 ms of elementwise work moving 4 GB: 100 GB/s on a device that copies at 1000.
        let mut ops = ops(DEVICE, 300.0, 5.0, &[], Some(95.0), (40.0, 4e9));
        ops["rows"] = json!([
            {"op": "convert F32->F16 [64]", "kind": "elementwise", "calls_per_step": 161.0,
             "ms_per_step": 20.0, "bytes_per_step": 1e9},
            {"op": "conv fwd 64->64 k3 s1 56²", "kind": "compute", "calls_per_step": 3.0,
             "ms_per_step": 30.0, "bytes_per_step": 0.0},
        ]);
        let d = diagnose(&report("cuda", 0.0, ops)).unwrap();
        assert_eq!(holding(&d), [Bottleneck::MemoryAccess]);
        let f = d.finding(Bottleneck::MemoryAccess);
        assert!(f.evidence.contains("100.0 GB/s") && f.evidence.contains("10.0% of"));
        assert!(
            f.evidence
                .contains("slowest: convert F32->F16 [64] 20.00 ms at 50.0 GB/s"),
            "{}",
            f.evidence
        );
        assert!(
            !f.evidence.contains("conv fwd"),
            "compute rows are not memory-bound"
        );
        assert!(f.fix.contains("NHWC") && f.fix.contains("fused"));
    }

    #[test]
    fn memory_bound_ops_faster_than_the_stream_bandwidth_are_in_cache() {
        // 20 GB/s on a device that streams at 10 (a CPU whose caches hold the activations).
        let mut r = report(
            "cpu",
            0.0,
            ops(
                "host timer (ops run synchronously)",
                900.0,
                99.0,
                &[],
                Some(99.0),
                (20.0, 4e8),
            ),
        );
        r["stream_gb_per_s"] = json!(10.0);
        let d = diagnose(&r).unwrap();
        let f = d.finding(Bottleneck::MemoryAccess);
        assert_eq!(f.status, Status::Clear);
        assert!(
            f.evidence
                .contains("at 20.0 GB/s — above this device's stream bandwidth (10.0 GB/s)"),
            "{}",
            f.evidence
        );
        r["ops"]["by_kind"]["elementwise"]["bytes_per_step"] = json!(1e5);
        r["ops"]["by_kind"]["reduction"]["bytes_per_step"] = json!(1e5);
        let f = diagnose(&r)
            .unwrap()
            .finding(Bottleneck::MemoryAccess)
            .clone();
        assert_eq!(f.status, Status::Holds, "20 ms a step at 0.010 GB/s: {f:?}");
        assert!(
            f.evidence.contains("at 0.010 GB/s — 0.1% of"),
            "{}",
            f.evidence
        );
    }

    #[test]
    fn a_wait_each_step_that_idles_the_device_is_named() {
        let ops = ops(
            DEVICE,
            300.0,
            10.0,
            &[("read_timestamps", 1.0, 30.0), ("download", 1.0, 2.0)],
            Some(50.0),
            (5.0, 4e9),
        );
        let d = diagnose(&report("cuda", 0.0, ops)).unwrap();
        assert_eq!(holding(&d), [Bottleneck::Synchronisation]);
        let f = d.finding(Bottleneck::Synchronisation);
        assert!(f
            .evidence
            .contains("read_timestamps ×1.0 (30.0 ms), download ×1.0 (2.0 ms)"));
        assert!(
            f.fix.starts_with("read_timestamps: the phase clock"),
            "{}",
            f.fix
        );
    }

    #[test]
    fn device_allocations_in_the_steady_state_are_named() {
        let ops = ops(DEVICE, 300.0, 10.0, &[], Some(95.0), (5.0, 4e9));
        let mut r = report("cuda", 0.0, ops);
        r["device_memory"] =
            json!({"device_allocations_measured": 0, "reserved_bytes": 1e9, "steps": 10});
        let d = diagnose(&r).unwrap();
        assert_eq!(d.finding(Bottleneck::Synchronisation).status, Status::Clear);
        r["device_memory"]["device_allocations_measured"] = json!(250);
        let d = diagnose(&r).unwrap();
        let f = d.finding(Bottleneck::Synchronisation);
        assert_eq!(f.status, Status::Holds, "{f:?}");
        assert!(
            f.evidence.contains("25.0 device allocations a step"),
            "{}",
            f.evidence
        );
        assert!(f.fix.contains("caching allocator"));
    }

    #[test]
    fn a_wait_for_a_busy_device_is_not_a_bottleneck() {
        // The host waits 40 ms because the device is busy 95% of the step: device-bound.
        let ops = ops(
            DEVICE,
            300.0,
            10.0,
            &[("read_timestamps", 1.0, 40.0)],
            Some(95.0),
            (5.0, 4e9),
        );
        let d = diagnose(&report("cuda", 0.0, ops)).unwrap();
        assert!(holding(&d).is_empty());
        assert!(d.verdict.contains("busy 95.0%") && d.verdict.contains("1234.5 GFLOP/s"));
    }

    #[test]
    fn two_reasons_are_ranked_by_their_share() {
        let ops = ops(DEVICE, 1500.0, 60.0, &[], Some(40.0), (5.0, 4e9));
        let d = diagnose(&report("cuda", 0.1, ops)).unwrap();
        assert_eq!(holding(&d), [Bottleneck::Launches, Bottleneck::Data]);
        assert!(d
            .verdict
            .starts_with("many short kernels, host-bound, then data loading"));
    }

    #[test]
    fn synchronous_devices_have_no_launch_or_sync_bottleneck() {
        let ops = ops(
            "host timer (ops run synchronously)",
            900.0,
            99.0,
            &[("synchronize", 5.0, 0.0)],
            Some(99.0),
            (10.0, 4e9),
        );
        let d = diagnose(&report("cpu", 0.01, ops)).unwrap();
        assert_eq!(
            d.finding(Bottleneck::Launches).status,
            Status::NotApplicable
        );
        assert_eq!(
            d.finding(Bottleneck::Synchronisation).status,
            Status::NotApplicable
        );
        // 10 ms of 99 is under the 15% that makes memory access a bottleneck.
        assert_eq!(d.finding(Bottleneck::MemoryAccess).status, Status::Clear);
        assert!(holding(&d).is_empty());
    }

    #[test]
    fn host_timed_ops_on_an_asynchronous_device_leave_memory_and_sync_unmeasured() {
        let ops = ops(
            "host timer (enqueue only)",
            300.0,
            10.0,
            &[("read_timestamps", 1.0, 60.0)],
            None,
            (1.0, 4e9),
        );
        let d = diagnose(&report("wgpu", 0.0, ops)).unwrap();
        assert_eq!(
            d.finding(Bottleneck::MemoryAccess).status,
            Status::NotMeasured
        );
        let sync = d.finding(Bottleneck::Synchronisation);
        assert_eq!(sync.status, Status::NotMeasured, "{sync:?}");
        assert!(sync.evidence.contains("--profile-ops"));
        assert!(
            d.verdict.contains("rerun with --profile-ops"),
            "{}",
            d.verdict
        );
    }

    #[test]
    fn a_report_without_ops_is_judged_on_data_alone() {
        let mut r = report("cuda", 0.0, Value::Null);
        r.as_object_mut().unwrap().remove("ops");
        let d = diagnose(&r).unwrap();
        assert_eq!(d.finding(Bottleneck::Data).status, Status::Clear);
        for b in [
            Bottleneck::Launches,
            Bottleneck::MemoryAccess,
            Bottleneck::Synchronisation,
        ] {
            assert_eq!(d.finding(b).status, Status::NotMeasured);
        }
    }

    #[test]
    fn a_training_report_is_judged_on_its_last_epoch() {
        let ops = ops(DEVICE, 300.0, 5.0, &[], Some(60.0), (5.0, 4e9));
        let epoch = |stall: f64| {
            json!({"epoch": 0, "steps": {"images_per_sec": 50.0, "step_mean_ms": 100.0,
                   "data_stall": stall, "ops": ops.clone()}})
        };
        let train = json!({
            "device": "cuda:0", "device_kind": "cuda", "model": "resnet50", "batch": 32,
            "resolution": 160, "workers": 2, "history": [epoch(0.0), epoch(0.5)],
        });
        let d = diagnose(&train).unwrap();
        assert_eq!(holding(&d), [Bottleneck::Data]);
        assert!(
            d.subject.contains("160px") && d.subject.contains("50.00 img/s"),
            "{}",
            d.subject
        );
        let old = json!({"history": [{"epoch": 0, "val_top1": 0.5}]});
        assert!(diagnose(&old)
            .unwrap_err()
            .0
            .contains("without step summaries"));
        assert!(diagnose(&json!({"x": 1})).is_err());
    }
}
