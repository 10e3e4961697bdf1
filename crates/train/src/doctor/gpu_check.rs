//! The doctor on a `redline-gpu-check` JSON: the one report a GPU machine without cargo gives.
//! Its speed stage measured our ResNet step fed from memory (busy fraction from CUDA events,
//! the host's time inside `train_step`, kernels per step from the replayed graph) and again
//! fed by the loader (its share of the memory-fed speed, the data stall); its training stage
//! counted a steady step's synchronisations and downloads; its op profile timed every op of a
//! few eager steps on the device. Memory access is judged on whether cuDNN and cuBLASLt ran
//! the step's convolutions and matmuls (our own kernels for them are far slower), then on the
//! op profile's memory-bound ops against the stream bandwidth, as for a bench report.

use serde_json::Value;

use super::{
    data_finding, holding_verdict, memory, not_measured, num, pct, text, Bottleneck, Diagnosis,
    Evidence, Finding, NotAReport, Ops, Status, BUSY, DATA_STALL, HOST_BOUND,
};

/// The loader-fed run's speed, as a share of the memory-fed run's, below which the loader
/// counts as holding the GPU back (issue 18's goal: within 5%).
pub const FED_SHARE: f64 = 0.95;

/// One report of gpu-check runs made one after another on the same machine and commit (a
/// short GPU window runs the correctness stages, then the speed stage alone): the later
/// report's fields, every report's stages in order. Reports of different commits or GPUs, or
/// that are not gpu-check's, are refused by name.
pub fn merge(reports: &[Value]) -> Result<Value, NotAReport> {
    let Some((last, earlier)) = reports.split_last() else {
        return Err(NotAReport("no report to merge".into()));
    };
    let mut stages = Vec::new();
    for (i, r) in reports.iter().enumerate() {
        let Some(own) = r.get("stages").and_then(Value::as_array) else {
            return Err(NotAReport(format!(
                "report {} of {} is not a gpu-check report (no stages): only those merge",
                i + 1,
                reports.len()
            )));
        };
        stages.extend(own.iter().cloned());
    }
    for key in ["commit", "binary_sha256"] {
        if let Some(other) = earlier.iter().find(|r| r[key] != last[key]) {
            return Err(NotAReport(format!(
                "the reports come from different builds ({key} {} and {}): merge only one \
                 pack's runs",
                other[key], last[key]
            )));
        }
    }
    let uuid = |r: &Value| r["gpu"]["uuid"].clone();
    if let Some(other) = earlier.iter().find(|r| uuid(r) != uuid(last)) {
        return Err(NotAReport(format!(
            "the reports come from different GPUs ({} and {}): merge only one machine's runs",
            uuid(other),
            uuid(last)
        )));
    }
    let mut merged = last.clone();
    merged["stages"] = Value::Array(stages);
    Ok(merged)
}

/// Judges a gpu-check report from its `stages`.
pub(super) fn diagnose(doc: &Value, stages: &[Value]) -> Result<Diagnosis, NotAReport> {
    let passed = |name: &str| {
        (stages.iter())
            .find(|s| s["name"] == name && s["passed"] == true)
            .map(|s| &s["detail"])
    };
    // A speed stage that failed or timed out after our side was measured kept it (`partial`):
    // judged, saying so.
    let cut_short = (stages.iter())
        .find(|s| {
            s["name"] == "speed" && s["passed"] != true && s["partial"]["redline"].is_object()
        })
        .map(|s| (&s["partial"], text(s, "error").unwrap_or_default()));
    let (speed, incomplete) = match (passed("speed"), cut_short) {
        (Some(speed), _) => (speed, None),
        (None, Some((partial, why))) => (partial, Some(why)),
        (None, None) => {
            return Err(NotAReport(
                "a gpu-check report without a passed speed stage (it needs a GPU and \
                 --speed-steps above 0): nothing measured to judge"
                    .into(),
            ))
        }
    };
    let ours = &speed["redline"];
    let (Some(seconds), Some(steps)) = (num(ours, "seconds"), num(ours, "steps")) else {
        return Err(NotAReport("the speed stage has no timed steps".into()));
    };
    let step_ms = 1e3 * seconds / steps.max(1.0);
    let busy = num(ours, "busy_fraction");
    let findings = vec![
        data(speed),
        launches(ours, busy),
        memory_access(speed, step_ms),
        synchronisation(passed("training"), busy),
    ];
    let subject = format!(
        "{} at {}px, batch {}, {} on {} (redline-gpu-check at commit {}): {:.0} img/s fed from \
         memory, {step_ms:.1} ms a step",
        text(speed, "model").unwrap_or_else(|| "a model".into()),
        num(speed, "res").unwrap_or(f64::NAN),
        num(speed, "batch").unwrap_or(f64::NAN),
        text(speed, "precision").unwrap_or_else(|| "?".into()),
        doc["gpu"]["name"].as_str().unwrap_or("a GPU"),
        text(doc, "commit").unwrap_or_else(|| "?".into()),
        num(ours, "img_per_s").unwrap_or(f64::NAN),
    );
    let subject = match incomplete {
        Some(why) => {
            format!("{subject} (the speed stage did not finish: {why}; judged on what it measured)")
        }
        None => subject,
    };
    let mut diagnosis = Diagnosis {
        subject,
        findings,
        verdict: String::new(),
    };
    diagnosis.verdict = holding_verdict(&diagnosis).unwrap_or_else(|| clear_verdict(speed, busy));
    Ok(diagnosis)
}

/// Memory access, as far as gpu-check sees it: first whether the vendor libraries ran the
/// convolutions and matmuls (the step's bulk), or redline's own kernels did — written to be
/// right, not fast (a direct convolution, far from cuDNN's speed); then, from the speed stage's
/// op profile (device time per op over eager steps, and the stream bandwidth), what share of
/// the ops' device time the memory-bound ops take and how fast they move memory, by the bench
/// report's thresholds.
fn memory_access(speed: &Value, step_ms: f64) -> Finding {
    let mut missing = Vec::new();
    let mut used = Vec::new();
    for (name, ops) in [("cuDNN", "convolution"), ("cuBLASLt", "matmul")] {
        let library = &speed["libraries"][name];
        if let Some(why) = library["not_used"].as_str() {
            missing.push(format!(
                "{name} was not used ({why}): every {ops} ran on our kernels"
            ));
        } else if let Some(refused) = library["refused_plans_on_our_kernels"].as_array() {
            match refused.first() {
                Some(first) => missing.push(format!(
                    "{name} refused {} {ops} plan(s), run on our kernels instead (first: {})",
                    refused.len(),
                    first.as_str().unwrap_or("?")
                )),
                None => used.push(name),
            }
        }
    }
    if missing.is_empty() {
        let libraries = match used.is_empty() {
            true => String::new(),
            false => format!("{} ran every plan of the step; ", used.join(" and ")),
        };
        let profile = &speed["redline_op_profile"];
        let ops = profile.get("ops").and_then(Ops::read);
        let why_not = match (&ops, text(profile, "error")) {
            (_, Some(e)) => Some(format!("the speed stage's op profile did not run: {e}")),
            (None, None) => Some(
                "the speed stage has no op profile (a report from before it had one, a stage \
                 cut short, or --speed-profile-steps 0)"
                    .into(),
            ),
            (Some(o), None) if !o.device_timed => {
                Some("the op profile has no device timestamps".into())
            }
            _ => None,
        };
        if let Some(why) = why_not {
            return not_measured(Bottleneck::MemoryAccess, &format!("{libraries}{why}"));
        }
        // Shares of the profile's own device time (same steps, same clock): its eager steps
        // are slower than the replay, so against the replayed step the share would be inflated.
        let device_ms = ops.as_ref().and_then(|o| o.device_ms).unwrap_or(step_ms);
        let evidence = Evidence {
            step_ms: device_ms,
            stall: 0.0,
            synchronous: false,
            ops,
            stream_gb_per_s: num(profile, "stream_gb_per_s"),
            allocations_per_step: None,
            graph_nodes: None,
        };
        let mut finding = memory(&evidence);
        finding.evidence = format!(
            "{libraries}timed op by op over eager steps, whose ops ran {device_ms:.1} ms a step \
             on the device (the device part below): {}",
            finding.evidence
        );
        return finding;
    }
    Finding {
        bottleneck: Bottleneck::MemoryAccess,
        status: Status::Holds,
        share: None,
        evidence: missing.join("; "),
        fix: "make the library loadable (PyTorch's wheels ship cuDNN 9 and cuBLASLt; \
              REDLINE_CUDA_LIB_DIR names a folder, and a second copy of one on the linker's path \
              is refused: see the report's `gpu.libraries`), or see why it refused each plan"
            .into(),
    }
}

/// None holds: how busy the device is, how fast, and against PyTorch where it ran.
fn clear_verdict(speed: &Value, busy: Option<f64>) -> String {
    let ours = &speed["redline"];
    let mut v = match busy {
        Some(b) => format!(
            "none of the measured reasons holds: the device is busy {}",
            pct(b)
        ),
        None => "none of the measured reasons holds".into(),
    };
    if let Some(t) = num(ours, "achieved_tflops") {
        v += &format!(" at {t:.1} TFLOP/s");
        if let Some(share) = num(speed, "share_of_peak") {
            v += &format!(" ({} of the card's tensor peak)", pct(share));
        }
    }
    if let Some(r) = num(speed, "ratio_vs_eager") {
        v += &format!(", {r:.2}× PyTorch eager");
    }
    v + " — the kernels themselves are what is left to speed up"
}

/// The loader-fed run against the memory-fed one.
fn data(speed: &Value) -> Finding {
    let Some(fed) = speed.get("redline_loader_fed").filter(|f| f.is_object()) else {
        return not_measured(
            Bottleneck::Data,
            "the speed stage ran without the loader-fed run: nothing says whether the loader \
             keeps up",
        );
    };
    let stall = num(fed, "data_stall").unwrap_or(f64::NAN);
    let share = num(speed, "loader_fed_share_of_memory_fed").unwrap_or(f64::NAN);
    let evidence = format!(
        "fed by the loader from JPEG shards on {} threads: {:.0} img/s, {} of the memory-fed \
         run's (goal ≥ {}); the step waited for data {} of the time",
        num(fed, "loader_workers").map_or_else(|| "?".into(), |w| format!("{w}")),
        num(fed, "img_per_s").unwrap_or(f64::NAN),
        pct(share),
        pct(FED_SHARE),
        pct(stall),
    );
    // A NaN (a figure missing) compares false: not held on no evidence.
    let holds = stall > DATA_STALL || share < FED_SHARE;
    data_finding(holds, stall.max(1.0 - share), evidence, None)
}

/// The host's time per step against the device's busy fraction.
fn launches(ours: &Value, busy: Option<f64>) -> Finding {
    let b = Bottleneck::Launches;
    let (Some(busy), Some(host_share)) = (busy, num(ours, "host_share_of_wall")) else {
        return not_measured(
            b,
            "the speed stage has no device timestamps (busy fraction)",
        );
    };
    let graph = &ours["graph"];
    let kernels = num(graph, "kernels_per_step").unwrap_or(0.0);
    let replayed = num(graph, "replays").is_some_and(|r| r > 0.0);
    let how = match replayed {
        true => format!("{kernels:.0} kernels a step, replayed as one CUDA graph"),
        false => format!(
            "every step issued eagerly ({})",
            text(graph, "eager_reason").unwrap_or_else(|| "no graph".into())
        ),
    };
    let evidence = format!(
        "{how}; the host spent {:.1} ms a step issuing it inside train_step ({} of the wall \
         time; its wait for the device apart); device busy {}",
        num(ours, "host_ms_per_step").unwrap_or(f64::NAN),
        pct(host_share),
        pct(busy.min(1.0)),
    );
    let holds = host_share >= HOST_BOUND && busy < BUSY;
    let fix = match (holds, replayed) {
        (false, _) => String::new(),
        (true, false) => "replay the step as a captured CUDA graph (`redline-gpu-check --graph`, \
                          `Trainer::with_graph`): one launch a step"
            .into(),
        (true, true) => format!(
            "the step is one graph launch of {kernels:.0} kernels, so the host's time is the \
             batch's copy or a wait: see the synchronisation finding; fuse short kernels to \
             shrink the graph"
        ),
    };
    Finding {
        bottleneck: b,
        status: if holds { Status::Holds } else { Status::Clear },
        share: Some(host_share.min(1.0)),
        evidence,
        fix,
    }
}

/// The training stage's counted steady step: synchronisations, and downloads besides the one
/// loss read-back the check itself makes.
fn synchronisation(training: Option<&Value>, busy: Option<f64>) -> Finding {
    let b = Bottleneck::Synchronisation;
    let Some(steady) = training
        .map(|t| &t["steady_state_step"])
        .filter(|s| s.is_object())
    else {
        return not_measured(
            b,
            "the training stage did not run (`--steps 0`): no steady step was counted",
        );
    };
    let syncs = num(steady, "synchronizations").unwrap_or(0.0);
    let downloads = (num(steady, "downloads").unwrap_or(0.0) - 1.0).max(0.0);
    let waits = syncs + downloads;
    let holds = waits > 0.0 && busy.is_none_or(|b| b < BUSY);
    let evidence = format!(
        "a steady training step made {syncs:.0} device synchronisations and {downloads:.0} \
         downloads besides the check's own loss read-back; device busy {}",
        busy.map_or_else(|| "not measured".into(), |b| pct(b.min(1.0)))
    );
    Finding {
        bottleneck: b,
        status: if holds { Status::Holds } else { Status::Clear },
        share: None,
        evidence,
        fix: match holds {
            true => "a step waits for the device: read values a few steps late \
                     (`to_vec_async`), and drop explicit synchronisations from the step"
                .into(),
            false => String::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A gpu-check report: the speed stage's figures, a loader-fed run, a counted steady step.
    fn report(busy: f64, host_share: f64, replays: u64, fed_share: f64, syncs: u64) -> Value {
        json!({
            "commit": "abc1234",
            "gpu": {"name": "NVIDIA H200"},
            "stages": [
                {"name": "device", "passed": true, "detail": {}},
                {"name": "training", "passed": true, "detail": {
                    "steady_state_step": {"uploads": 2, "downloads": 1, "synchronizations": syncs},
                }},
                {"name": "speed", "passed": true, "detail": {
                    "model": "resnet50", "res": 224, "batch": 256, "precision": "bf16",
                    "share_of_peak": 0.31, "ratio_vs_eager": 1.12,
                    "loader_fed_share_of_memory_fed": fed_share,
                    "redline_loader_fed": {"img_per_s": 3000.0 * fed_share, "data_stall": 0.01,
                                           "loader_workers": 16},
                    "redline": {
                        "img_per_s": 3000.0, "seconds": 1.7, "steps": 20,
                        "busy_fraction": busy, "host_share_of_wall": host_share,
                        "host_ms_per_step": 85.0 * host_share, "achieved_tflops": 305.0,
                        "graph": {"kernels_per_step": 820, "replays": replays,
                                  "eager_reason": if replays == 0 { json!("no capture") } else { json!(null) }},
                    },
                }},
            ],
        })
    }

    fn holding(d: &Diagnosis) -> Vec<Bottleneck> {
        d.holding().iter().map(|f| f.bottleneck).collect()
    }

    #[test]
    fn a_busy_gpu_fed_as_fast_by_the_loader_holds_nothing_and_says_how_fast() {
        let d = super::super::diagnose(&report(0.97, 0.9, 22, 0.99, 0)).unwrap();
        assert!(holding(&d).is_empty(), "{d}");
        assert!(d
            .subject
            .contains("resnet50 at 224px, batch 256, bf16 on NVIDIA H200"));
        assert!(d.subject.contains("abc1234") && d.subject.contains("3000 img/s"));
        assert!(d.verdict.contains("busy 97.0%") && d.verdict.contains("305.0 TFLOP/s"));
        assert!(
            d.verdict.contains("31.0% of the card's tensor peak") && d.verdict.contains("1.12×")
        );
        // Without the speed stage's op profile, memory access is said to be unmeasured.
        let memory = d.finding(Bottleneck::MemoryAccess);
        assert_eq!(memory.status, Status::NotMeasured);
        assert!(memory.evidence.contains("--speed-profile-steps 0"), "{d}");
    }

    /// The speed stage's op profile: memory-bound ops taking `ms` of each step and moving
    /// `bytes`, the device's stream bandwidth 3,000 GB/s.
    fn profiled(ms: f64, bytes: f64) -> Value {
        let mut r = report(0.97, 0.9, 22, 0.99, 0);
        let kind = |share: f64| {
            json!({"calls_per_step": 300, "ms_per_step": ms * share,
                                       "bytes_per_step": bytes * share})
        };
        r["stages"][2]["detail"]["redline_op_profile"] = json!({
            "steps": 2, "stream_gb_per_s": 3000.0,
            "ops": {
                "clock": "device timestamps", "launches_per_step": 900.0,
                "host_issue_ms_per_step": 20.0, "blocked_ms_per_step": 0.0, "blocking_calls": [],
                "device_ms_per_step": 80.0,
                "by_kind": {"elementwise": kind(0.75), "reduction": kind(0.25)},
                "rows": [{"op": "binary mul bf16 [256, 256, 56, 56]", "kind": "elementwise",
                          "calls_per_step": 3.0, "ms_per_step": ms / 2.0,
                          "bytes_per_step": bytes / 4.0}],
            },
        });
        r
    }

    /// With the op profile, memory access is judged against the profile's own device time
    /// (80 ms a step here; the replayed step, 85 ms, is another run): slow memory-bound ops
    /// hold, fast ones are clear; a profile that did not run or has no device clock is said
    /// to be.
    #[test]
    fn the_op_profile_judges_memory_access_against_its_own_device_time() {
        // 30 ms of 80 moving 15 GB: 500 GB/s, a sixth of the stream bandwidth.
        let d = super::super::diagnose(&profiled(30.0, 15e9)).unwrap();
        assert_eq!(holding(&d), [Bottleneck::MemoryAccess], "{d}");
        let f = d.finding(Bottleneck::MemoryAccess);
        assert!(
            f.evidence.contains("timed op by op over eager steps"),
            "{d}"
        );
        assert!(
            f.evidence.contains("ran 80.0 ms a step on the device"),
            "{d}"
        );
        assert!(f.evidence.contains("37.5% of the device part"), "{d}");
        assert!(
            f.evidence
                .contains("16.7% of this device's stream bandwidth"),
            "{d}"
        );
        assert!(f.evidence.contains("binary mul bf16"), "{d}");
        assert!(f.fix.contains("layout and fusion"), "{d}");
        // 5 ms moving 12.5 GB: 2,500 GB/s.
        let d = super::super::diagnose(&profiled(5.0, 12.5e9)).unwrap();
        let f = d.finding(Bottleneck::MemoryAccess);
        assert_eq!(f.status, Status::Clear, "{d}");
        assert!(holding(&d).is_empty(), "{d}");
        let mut r = profiled(5.0, 12.5e9);
        r["stages"][2]["detail"]["redline_op_profile"] = json!({"error": "out of memory"});
        let d = super::super::diagnose(&r).unwrap();
        let f = d.finding(Bottleneck::MemoryAccess);
        assert_eq!(f.status, Status::NotMeasured, "{d}");
        assert!(
            f.evidence.contains("op profile did not run: out of memory"),
            "{d}"
        );
        let mut r = profiled(5.0, 12.5e9);
        r["stages"][2]["detail"]["redline_op_profile"]["ops"]["clock"] =
            json!("host timer (enqueue only)");
        let d = super::super::diagnose(&r).unwrap();
        let f = d.finding(Bottleneck::MemoryAccess);
        assert_eq!(f.status, Status::NotMeasured, "{d}");
        assert!(f.evidence.contains("no device timestamps"), "{d}");
    }

    #[test]
    fn a_loader_that_falls_behind_the_memory_fed_run_is_named() {
        let d = super::super::diagnose(&report(0.97, 0.9, 22, 0.80, 0)).unwrap();
        assert_eq!(holding(&d), [Bottleneck::Data]);
        let f = d.finding(Bottleneck::Data);
        assert!(
            f.evidence.contains("80.0% of the memory-fed run's"),
            "{}",
            f.evidence
        );
        assert!(f.evidence.contains("16 threads"), "{}", f.evidence);
        assert!(f.fix.contains("more loader workers"), "{}", f.fix);
    }

    #[test]
    fn a_host_bound_eager_step_asks_for_a_graph_and_a_graphed_one_for_the_waits() {
        let d = super::super::diagnose(&report(0.4, 0.95, 0, 0.99, 0)).unwrap();
        assert_eq!(holding(&d), [Bottleneck::Launches]);
        let f = d.finding(Bottleneck::Launches);
        assert!(
            f.evidence.contains("issued eagerly (no capture)"),
            "{}",
            f.evidence
        );
        assert!(f.fix.contains("captured CUDA graph"), "{}", f.fix);
        let d = super::super::diagnose(&report(0.4, 0.95, 22, 0.99, 0)).unwrap();
        let f = d.finding(Bottleneck::Launches);
        assert!(
            f.evidence.contains("820 kernels a step, replayed"),
            "{}",
            f.evidence
        );
        assert!(f.fix.contains("synchronisation finding"), "{}", f.fix);
    }

    #[test]
    fn a_steady_step_that_synchronises_while_the_gpu_idles_is_named() {
        let d = super::super::diagnose(&report(0.6, 0.3, 22, 0.99, 2)).unwrap();
        assert_eq!(holding(&d), [Bottleneck::Synchronisation]);
        let f = d.finding(Bottleneck::Synchronisation);
        assert!(
            f.evidence.contains("2 device synchronisations"),
            "{}",
            f.evidence
        );
        assert!(d.verdict.starts_with("synchronisation"), "{}", d.verdict);
    }

    #[test]
    fn a_report_without_a_passed_speed_stage_is_refused_naming_why() {
        let mut r = report(0.9, 0.5, 22, 0.99, 0);
        r["stages"][2]["passed"] = json!(false);
        let e = super::super::diagnose(&r).unwrap_err();
        assert!(
            e.to_string().contains("without a passed speed stage"),
            "{e}"
        );
        // Without the training stage or the loader-fed run, those reasons are unmeasured.
        let mut r = report(0.9, 0.5, 22, 0.99, 0);
        r["stages"][1]["passed"] = json!(false);
        r["stages"][2]["detail"]["redline_loader_fed"] = json!(null);
        let d = super::super::diagnose(&r).unwrap();
        for b in [Bottleneck::Data, Bottleneck::Synchronisation] {
            assert_eq!(d.finding(b).status, Status::NotMeasured, "{d}");
        }
    }

    /// A short window's two runs — correctness (with the counted training step), then the
    /// speed stage alone — judged as one; runs of other builds or GPUs are refused.
    #[test]
    fn two_runs_of_one_pack_merge_into_one_report_and_others_are_refused() {
        let whole = report(0.97, 0.9, 22, 0.80, 3);
        let stages = whole["stages"].as_array().unwrap();
        let run = |names: &[&str]| {
            let mut r = whole.clone();
            r["stages"] = json!(stages
                .iter()
                .filter(|s| names.iter().any(|n| s["name"] == *n))
                .collect::<Vec<_>>());
            r
        };
        let (check, speed) = (run(&["device", "training"]), run(&["device", "speed"]));
        // Alone, the correctness run has no speed stage to judge.
        assert!(super::super::diagnose(&check).is_err());
        let merged = merge(&[check.clone(), speed.clone()]).unwrap();
        let d = super::super::diagnose(&merged).unwrap();
        // The data finding from the speed run, the synchronisations from the training stage.
        assert_eq!(holding(&d), [Bottleneck::Data], "{d}");
        let sync = d.finding(Bottleneck::Synchronisation);
        assert_ne!(sync.status, Status::NotMeasured, "{d}");
        assert!(sync.evidence.contains("3 device synchronisations"), "{d}");
        let mut other = speed.clone();
        other["commit"] = json!("def5678");
        let e = merge(&[check.clone(), other]).unwrap_err().to_string();
        assert!(
            e.contains("different builds") && e.contains("def5678"),
            "{e}"
        );
        let mut other = speed.clone();
        other["gpu"]["uuid"] = json!("GPU-2");
        let e = merge(&[check.clone(), other]).unwrap_err().to_string();
        assert!(e.contains("different GPUs"), "{e}");
        let e = merge(&[check, json!({"images_per_sec": 3.0})]).unwrap_err();
        assert!(e
            .to_string()
            .contains("report 2 of 2 is not a gpu-check report"));
    }

    /// Convolutions on our direct kernels (cuDNN missing, or a plan refused) are named with the
    /// way back to cuDNN; both libraries in use leave memory access unmeasured, as said.
    #[test]
    fn convolutions_off_cudnn_are_named_and_both_libraries_in_use_are_said() {
        let with = |libraries: Value| {
            let mut r = report(0.97, 0.9, 22, 0.99, 0);
            r["stages"][2]["detail"]["libraries"] = libraries;
            super::super::diagnose(&r).unwrap()
        };
        let used = json!({"path": "/x", "version": "9", "refused_plans_on_our_kernels": []});
        let d = with(json!({"cuDNN": {"not_used": "libcudnn.so.9 not found"}, "cuBLASLt": used}));
        assert_eq!(holding(&d), [Bottleneck::MemoryAccess], "{d}");
        let f = d.finding(Bottleneck::MemoryAccess);
        assert!(
            f.evidence
                .contains("cuDNN was not used (libcudnn.so.9 not found)"),
            "{d}"
        );
        assert!(f.fix.contains("REDLINE_CUDA_LIB_DIR"), "{d}");
        let refused = json!({"path": "/x", "version": "9",
                             "refused_plans_on_our_kernels": ["conv 7x7: BAD_PARAM"]});
        let d = with(json!({"cuDNN": refused, "cuBLASLt": used}));
        let f = d.finding(Bottleneck::MemoryAccess);
        assert!(f.evidence.contains("refused 1 convolution plan(s)"), "{d}");
        assert!(f.evidence.contains("conv 7x7: BAD_PARAM"), "{d}");
        let d = with(json!({"cuDNN": used, "cuBLASLt": used}));
        let f = d.finding(Bottleneck::MemoryAccess);
        assert_eq!(f.status, Status::NotMeasured, "{d}");
        assert!(
            f.evidence.contains("cuDNN and cuBLASLt ran every plan"),
            "{d}"
        );
    }

    /// A speed stage ended by its timeout after our side was measured is judged on what it
    /// kept, saying so; one that kept nothing is refused.
    #[test]
    fn a_speed_stage_cut_short_is_judged_on_what_it_kept() {
        let mut r = report(0.97, 0.9, 22, 0.99, 0);
        let detail = r["stages"][2]["detail"].clone();
        r["stages"][2] = json!({"name": "speed", "passed": false, "error": "still running after 220 s",
                                "partial": detail});
        let d = super::super::diagnose(&r).unwrap();
        assert!(
            d.subject
                .contains("the speed stage did not finish: still running after 220 s"),
            "{d}"
        );
        assert!(d.subject.contains("3000 img/s"), "{d}");
        r["stages"][2]["partial"] = json!({"model": "resnet50"});
        assert!(super::super::diagnose(&r).is_err());
    }
}
