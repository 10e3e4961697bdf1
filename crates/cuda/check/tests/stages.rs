//! The check's command line as a GPU window uses it, on the host emulator: `--skip` leaves
//! stages out, and a stage past `--stage-timeout` ends the process with exit code 124 and a
//! JSON that holds what finished and the stage that timed out.

use std::process::Command;

use serde_json::Value;

/// `redline-gpu-check --emulate` with `args`: its exit code and its JSON report.
fn run(name: &str, args: &[&str]) -> (Option<i32>, Value) {
    let json = std::env::temp_dir().join(format!("gpu-check-{name}-{}.json", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_redline-gpu-check"))
        .args(["--emulate", "--steps", "0", "--speed-steps", "0", "--json"])
        .arg(&json)
        .args(args)
        .output()
        .unwrap();
    let text = std::fs::read_to_string(&json)
        .unwrap_or_else(|e| panic!("no JSON ({e}): {}", String::from_utf8_lossy(&output.stderr)));
    let _ = std::fs::remove_file(&json);
    (output.status.code(), serde_json::from_str(&text).unwrap())
}

fn stage_names(doc: &Value) -> Vec<&str> {
    let stages = doc["stages"].as_array().unwrap();
    stages.iter().filter_map(|s| s["name"].as_str()).collect()
}

#[test]
fn skipped_stages_do_not_run_and_the_report_lists_them() {
    let skip = "conformance,amp,own-kernels,wgpu,nccl";
    let (code, doc) = run("skip", &["--skip", skip]);
    assert_eq!(code, Some(0), "{doc}");
    assert_eq!(stage_names(&doc), ["device", "graph"], "{doc}");
    assert_eq!(doc["skipped"].as_array().unwrap().len(), 5, "{doc}");
    assert_eq!(doc["passed"], true, "{doc}");
}

/// The conformance suite takes the emulator many seconds: a one-second limit ends it.
#[test]
fn a_stage_past_its_time_ends_the_process_and_the_report_says_which() {
    let (code, doc) = run("timeout", &["--stage-timeout", "1"]);
    assert_eq!(code, Some(124), "{doc}");
    assert_eq!(stage_names(&doc), ["device", "conformance"], "{doc}");
    assert_eq!(doc["stages"][0]["passed"], true, "{doc}");
    let timed_out = &doc["stages"][1];
    assert_eq!(timed_out["passed"], false, "{doc}");
    let error = timed_out["error"].as_str().unwrap();
    assert!(
        error.contains("still running after 1 s") && error.contains("--skip conformance"),
        "{error}"
    );
    assert_eq!(doc["timed_out"], "conformance", "{doc}");
    assert_eq!(doc["passed"], false, "{doc}");
}
