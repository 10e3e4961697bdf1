//! The doctor on real runs: `redline-train` trains a ResNet-18 for an epoch on a small
//! synthetic JPEG shard set, on the CPU backend and on a wgpu adapter (software Vulkan in CI),
//! and `redline-doctor` reads its report.

use std::path::Path;
use std::process::Command;

use redline_datasets::generate::{synth_shards, SynthOptions};
use serde_json::Value;

/// Trains on `device` and returns the report and the doctor's text and JSON answers.
fn train_and_diagnose(device: &str, dir: &Path) -> (Value, String, Value) {
    let options = SynthOptions {
        classes: 2,
        images: 16,
        seed: 3,
        threads: 2,
        ..SynthOptions::default()
    };
    synth_shards(&dir.join("data"), &options).expect("synthetic shards");
    let report = dir.join("run.json");
    let out = Command::new(env!("CARGO_BIN_EXE_redline-train"))
        .arg("--data")
        .arg(dir.join("data"))
        .args([
            "--device", device, "--model", "resnet18", "--res", "32", "--batch", "4",
        ])
        .args(["--epochs", "1", "--workers", "2", "--checkpoints"])
        .arg(dir.join("checkpoints"))
        .arg("--json")
        .arg(&report)
        .output()
        .expect("redline-train runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report_json: Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let doctor = |json: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_redline-doctor"));
        cmd.arg(&report);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.output().expect("redline-doctor runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let text = doctor(false);
    let json = serde_json::from_str(&doctor(true)).unwrap();
    (report_json, text, json)
}

fn status<'a>(diagnosis: &'a Value, bottleneck: &str) -> &'a str {
    let findings = diagnosis["findings"].as_array().unwrap();
    let f = findings.iter().find(|f| f["bottleneck"] == bottleneck);
    f.and_then(|f| f["status"].as_str()).unwrap()
}

#[test]
fn the_doctor_reads_a_real_cpu_training_run() {
    let dir = tempfile::tempdir().unwrap();
    let (report, text, d) = train_and_diagnose("cpu", dir.path());
    let steps = &report["history"][0]["steps"];
    assert_eq!(steps["steps"], 4, "16 images in batches of 4: {steps}");
    let ops = &steps["ops"];
    assert_eq!(ops["clock"], "host timer (ops run synchronously)");
    // A ResNet-18 step issues a few hundred ops; convolutions are among them.
    assert!(ops["launches_per_step"].as_f64().unwrap() > 100.0, "{ops}");
    assert!(
        ops["by_kind"]["compute"]["calls_per_step"]
            .as_f64()
            .unwrap()
            >= 20.0
    );
    assert!(
        ops["by_kind"]["elementwise"]["bytes_per_step"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(steps["stream_gb_per_s"].as_f64().unwrap() > 0.0);
    assert!(
        steps["device_memory"].is_null(),
        "the CPU backend keeps no allocator statistics"
    );
    // On the synchronous CPU backend, launches and waits cannot starve a queue; data and
    // memory access are judged from measurements.
    assert_eq!(status(&d, "many short kernels, host-bound"), "n/a");
    assert_eq!(status(&d, "synchronisation"), "n/a");
    for measured in ["data loading", "memory access"] {
        assert!(
            ["holds", "clear"].contains(&status(&d, measured)),
            "{measured}: {d:#}"
        );
    }
    assert!(
        text.contains("resnet18 at 32px, batch 4, fp32 on cpu"),
        "{text}"
    );
    assert!(text.contains("verdict: "), "{text}");
}

#[test]
fn the_doctor_reads_a_real_wgpu_training_run() {
    // Software Vulkan (lavapipe) in CI, where the wgpu suite is required.
    let required = std::env::var("CI").is_ok_and(|v| v == "true")
        || std::env::var("REDLINE_HARDWARE_REQUIRED").is_ok_and(|v| v == "1");
    if redline_wgpu::adapters().is_empty() {
        assert!(!required, "no wgpu adapter, and CI requires one");
        println!("redline-hardware-skip: no wgpu adapter");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (report, text, d) = train_and_diagnose("wgpu", dir.path());
    let ops = &report["history"][0]["steps"]["ops"];
    // The buffer pool served every step after the epoch's first from its cache.
    let memory = &report["history"][0]["steps"]["device_memory"];
    assert_eq!(memory["steps"], 3, "{memory}");
    assert_eq!(memory["device_allocations_measured"], 0, "{memory}");
    assert!(
        memory["reuses_measured"].as_u64().unwrap() > 100,
        "{memory}"
    );
    // An asynchronous device: host time only times the enqueueing, and the report says so.
    assert_eq!(ops["clock"], "host timer (enqueue only)", "{ops}");
    assert!(ops["device_ms_per_step"].is_null());
    // The phase clock's read of each step's timestamps is a wait the profile sees, by name
    // (the run counts ops without --profile-ops' detail).
    let blocking = ops["blocking_calls"].as_array().unwrap();
    assert!(
        blocking.iter().any(|b| b["call"] == "read_timestamps"),
        "{blocking:?}"
    );
    // And the doctor names it.
    assert!(text.contains("read_timestamps ×"), "{text}");
    // Launch overhead is judged; memory access needs device time per op.
    assert!(["holds", "clear"].contains(&status(&d, "many short kernels, host-bound")));
    assert_eq!(status(&d, "memory access"), "not measured");
    assert!(text.contains("on wgpu:"), "{text}");
}
