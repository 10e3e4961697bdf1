//! The scaling stage's harness without GPUs: real `redline-gpu-check scale-rank` processes,
//! placed by torchrun's variables, meeting through the rendezvous and training a small ResNet
//! data-parallel on the CPU backend over the TCP collective. What it proves is the harness —
//! processes, rendezvous, reports, the efficiency's arithmetic, failures and timeouts — not a
//! scaling figure: that needs several GPUs (`gpu-check --nproc N`).

use std::path::PathBuf;
use std::time::Duration;

use redline_gpu_check::scaling::{job, job_img_per_s, stage, RankOptions, ScaleOptions};

fn tiny(nproc: usize) -> ScaleOptions {
    ScaleOptions {
        nproc,
        rank: RankOptions {
            model: "resnet18".into(),
            res: 16,
            batch: 2,
            warmup: 1,
            steps: 2,
            cpu: true,
            eager: false,
        },
        binary: PathBuf::from(env!("CARGO_BIN_EXE_redline-gpu-check")),
        timeout: Duration::from_secs(300),
    }
}

/// A rank's `graph` report: a graph was asked for, none replayed, for a reason that says `why`.
fn assert_graph_refused(graph: &serde_json::Value, why: &str, report: &serde_json::Value) {
    assert_eq!(
        (graph["requested"].as_bool(), graph["replays"].as_u64()),
        (Some(true), Some(0)),
        "{report}"
    );
    let reason = graph["eager_reason"].as_str().unwrap_or_default();
    assert!(reason.contains(why), "{reason}: {report}");
}

#[test]
fn two_ranks_train_data_parallel_and_the_stage_reports_their_efficiency() {
    let report = stage(&tiny(2)).unwrap_or_else(|e| panic!("{e}"));
    let ranks = report["ranks"].as_array().expect("each rank's report");
    assert_eq!(ranks.len(), 2, "{report}");
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(rank["rank"], r, "{report}");
        assert_eq!(rank["world"], 2, "{report}");
        assert_eq!(rank["steps"], 2, "{report}");
        // Data parallel for real: gradients went out in buckets.
        assert!(rank["buckets"].as_u64().unwrap() > 0, "{report}");
        assert!(rank["loss"].as_f64().unwrap().is_finite(), "{report}");
        // Asked for a graph, every step ran eagerly, saying why: the TCP collective runs on
        // the host (and the CPU could not capture anyway).
        assert_graph_refused(
            &rank["graph"],
            "collective that cannot be captured",
            &report,
        );
    }
    // The one-process job trains alone: no buckets, and the CPU cannot capture.
    let one = &report["one_process"][0];
    assert_graph_refused(&one["graph"], "cannot capture graphs", &report);
    assert_eq!(
        (one["world"].as_u64(), one["buckets"].as_u64()),
        (Some(1), Some(0))
    );
    let (one_ips, many_ips) = (
        report["one_process_img_per_s"].as_f64().unwrap(),
        report["img_per_s"].as_f64().unwrap(),
    );
    assert!(one_ips > 0.0 && many_ips > 0.0, "{report}");
    let efficiency = report["scaling_efficiency"].as_f64().unwrap();
    assert!(
        (efficiency - many_ips / (2.0 * one_ips)).abs() < 1e-9,
        "{report}"
    );
    assert_eq!(report["collective"], "TCP on loopback");
}

#[test]
fn a_job_counts_every_ranks_images_over_the_slowest_rank() {
    let reports = [
        serde_json::json!({"batch": 4, "steps": 10, "seconds": 2.0}),
        serde_json::json!({"batch": 4, "steps": 10, "seconds": 4.0}),
    ];
    assert_eq!(job_img_per_s(&reports).unwrap(), 80.0 / 4.0);
    let err = job_img_per_s(&[serde_json::json!({"batch": 4})]).unwrap_err();
    assert!(err.contains("lacks"), "{err}");
}

#[test]
fn a_rank_that_fails_stops_the_job_and_is_named() {
    let mut options = tiny(2);
    options.rank.model = "resnet-nonesuch".into();
    let err = job(&options, 2).unwrap_err();
    assert!(err.starts_with("rank "), "{err}");
    assert!(err.contains("resnet-nonesuch"), "{err}");
    // The stage's error points at eager steps when the ranks were replaying graphs.
    let err = stage(&options).unwrap_err();
    assert!(
        err.contains("rank 0") && err.contains("--scale-eager"),
        "{err}"
    );
    options.rank.eager = true;
    let err = stage(&options).unwrap_err();
    assert!(!err.contains("--scale-eager"), "{err}");
}

#[test]
fn a_job_past_its_timeout_is_stopped() {
    let mut options = tiny(2);
    options.timeout = Duration::ZERO;
    let err = job(&options, 2).unwrap_err();
    assert!(
        err.contains("still running") && err.contains("stopped"),
        "{err}"
    );
}

#[test]
fn a_missing_executable_or_too_few_processes_is_refused() {
    let mut options = tiny(2);
    options.binary = PathBuf::from("/no/such/redline-gpu-check");
    let err = job(&options, 2).unwrap_err();
    assert!(err.contains("could not start rank 0"), "{err}");
    let err = stage(&tiny(1)).unwrap_err();
    assert!(err.contains("at least 2"), "{err}");
}

/// On CUDA the stage first counts the GPUs: a machine without a driver (CI) or with fewer GPUs
/// than processes is told so before any rank starts.
#[test]
fn more_processes_than_gpus_is_refused_before_starting_ranks() {
    let mut options = tiny(64);
    options.rank.cpu = false;
    options.binary = PathBuf::from("/no/such/redline-gpu-check");
    let err = stage(&options).unwrap_err();
    let said_why = err.contains("needs 64 GPUs") || err.contains("driver");
    assert!(said_why && !err.contains("could not start"), "{err}");
}
