//! `redline-train` as a data-parallel job: two processes started with torchrun's variables
//! train a ResNet-18 on the CPU over the TCP collective (with synchronised batch norm and
//! gradient accumulation, or without), rank 0 alone writes the checkpoint and
//! the report, and that checkpoint resumes in a single process or in three (an epoch's
//! checkpoint is at the next epoch's start, which any world size continues) — with the seed it
//! was trained with, or not at all.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use redline_datasets::generate::{synth_shards, SynthOptions};
use serde_json::Value;

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

fn train(dir: &Path, report: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_redline-train"));
    cmd.arg("--data")
        .arg(dir.join("data"))
        .args([
            "--device", "cpu", "--model", "resnet18", "--res", "32", "--batch", "4",
        ])
        .args(["--workers", "1", "--checkpoints"])
        .arg(dir.join("checkpoints"))
        .arg("--json")
        .arg(dir.join(report))
        .args(extra)
        .env("REDLINE_CPU_THREADS", "1")
        .env("REDLINE_DIST_TIMEOUT", "120");
    cmd
}

fn succeeded(out: &Output, who: &str) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{who}: {stderr}");
    stderr
}

/// Starts the `world` ranks of a job with `extra` arguments, each writing `{prefix}{rank}.json`;
/// returns their stderr.
fn job(dir: &Path, world: usize, prefix: &str, extra: &[&str]) -> Vec<String> {
    let port = free_port().to_string();
    let ranks: Vec<_> = (0..world)
        .map(|rank| {
            train(dir, &format!("{prefix}{rank}.json"), extra)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    ranks
        .into_iter()
        .enumerate()
        .map(|(rank, c)| succeeded(&c.wait_with_output().unwrap(), &format!("rank {rank}")))
        .collect()
}

/// Ranks 0 and 1 of a two-process job (reports `rank0.json`, `rank1.json`).
fn two_ranks(dir: &Path, extra: &[&str]) -> [String; 2] {
    let out = job(dir, 2, "rank", extra);
    [out[0].clone(), out[1].clone()]
}

fn synthetic(dir: &Path) {
    let options = SynthOptions {
        classes: 2,
        images: 32,
        seed: 5,
        threads: 2,
        ..SynthOptions::default()
    };
    synth_shards(&dir.join("data"), &options).expect("synthetic shards");
}

#[test]
fn two_ranks_with_synchronised_batch_norm_and_gradient_accumulation_train_a_resnet() {
    let dir = tempfile::tempdir().unwrap();
    synthetic(dir.path());
    let extra = [
        "--epochs",
        "1",
        "--sync-bn",
        "--accumulate",
        "2",
        "--bucket-mb",
        "1",
    ];
    let [lead, _] = two_ranks(dir.path(), &extra);
    assert!(lead.contains("rank 0 of 2 (data parallel"), "{lead}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("rank0.json")).unwrap())
            .unwrap();
    assert_eq!(
        (report["world"].as_u64(), report["accumulate"].as_u64()),
        (Some(2), Some(2))
    );
    assert!(report["final_val_top1"].as_f64().is_some(), "{report}");
    // ResNet-18's 45 MB of f32 gradients in buckets of 1 MiB (a tensor larger than a bucket
    // goes alone; DDP's 25 MiB makes 2 or 3).
    let buckets = &report["data_parallel"];
    assert_eq!(buckets["bucket_bytes"], 1 << 20, "{buckets}");
    assert!(buckets["buckets"].as_u64().unwrap() >= 15, "{buckets}");
    // 16 images per rank in batches of 4: 2 optimizer steps of 2 batches (8 images) each.
    let steps = &report["history"][0]["steps"];
    assert_eq!(
        (steps["steps"].as_u64(), steps["batch"].as_u64()),
        (Some(2), Some(8)),
        "{steps}"
    );
}

#[test]
fn an_accumulation_longer_than_an_epoch_or_an_empty_bucket_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    synthetic(dir.path());
    // A one-epoch run with `flag value`: refused, its error naming the problem.
    let refused = |flag: &str, value: &str, message: &str| {
        let out = train(dir.path(), "refused.json", &["--epochs", "1", flag, value])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} ran: {stderr}");
        assert!(stderr.contains(message), "{stderr}");
    };
    for k in ["0", "9"] {
        let message = format!("--accumulate {k}: between 1 and the 8 batches");
        refused("--accumulate", k, &message);
    }
    for mb in ["0", "-2", "NaN"] {
        refused("--bucket-mb", mb, "a bucket needs at least a byte");
    }
}

#[test]
fn two_ranks_train_and_their_checkpoint_resumes_in_one_process_or_three() {
    let dir = tempfile::tempdir().unwrap();
    synthetic(dir.path());
    let [lead, _] = two_ranks(dir.path(), &["--epochs", "1"]);
    assert!(lead.contains("rank 0 of 2 (data parallel"), "{lead}");
    // Rank 0 reports; rank 1 writes no report of its own.
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("rank0.json")).unwrap())
            .unwrap();
    assert!(!dir.path().join("rank1.json").exists());
    assert_eq!(report["world"], 2);
    assert_eq!(report["data_parallel"]["bucket_bytes"], 25 << 20);
    assert!(report["data_parallel"]["buckets"].as_u64().unwrap() <= 3);
    // 32 training images, 16 per rank: 4 steps of 4 images each.
    let steps = &report["history"][0]["steps"];
    println!("2 ranks: {}", report["history"][0]);
    let checkpoint = dir.path().join("checkpoints/epoch0.safetensors");
    assert!(checkpoint.exists());
    let resume = ["--epochs", "2", "--resume", checkpoint.to_str().unwrap()];

    // Another seed would change the data order: refused, naming both.
    let out = train(
        dir.path(),
        "reseeded.json",
        &[&resume[..], &["--seed", "3"]].concat(),
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("trained with --seed 0, and this run has --seed 3"),
        "{stderr}"
    );

    let out = train(dir.path(), "resumed.json", &resume).output().unwrap();
    let stderr = succeeded(&out, "the resumed single process");
    // The epoch's checkpoint is at the next epoch's start: one process continues there.
    assert!(stderr.contains("step 4, epoch 1, sample 0"), "{stderr}");
    let resumed: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("resumed.json")).unwrap())
            .unwrap();
    assert_eq!(resumed["world"], 1);
    let epochs: Vec<u64> = (resumed["history"].as_array().unwrap().iter())
        .map(|h| h["epoch"].as_u64().unwrap())
        .collect();
    assert_eq!(epochs, [1], "{steps}");

    // So do three, though 3 does not divide the 32 samples the two ranks consumed (a
    // checkpoint of the epoch's last position would be refused: no equal shares of 32).
    let three = job(dir.path(), 3, "three", &resume);
    assert!(
        three[0].contains("step 4, epoch 1, sample 0"),
        "{}",
        three[0]
    );
    let resumed: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("three0.json")).unwrap())
            .unwrap();
    assert_eq!(resumed["world"], 3);
    // ceil(32 / 3) = 11 images per rank, 2 steps of 4 an epoch: the one-cycle schedule goes
    // on from the end of epoch 0 in those steps (step 2 of 4), not from step 4 (its end,
    // where the job would stop at once).
    assert!(
        three[0].contains("the schedule continues at step 2 of 4"),
        "{}",
        three[0]
    );
    assert_eq!(resumed["history"][0]["epoch"], 1);
    assert_eq!(resumed["history"][0]["steps"]["steps"], 2, "{resumed}");
}
