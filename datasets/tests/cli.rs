//! The `redline-data` binary: exit codes and messages a user (and `cargo xtask`) relies on.

use std::fs;
use std::path::Path;
use std::process::{Command, Output};

fn data(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_redline-data"))
        .args(args)
        .output()
        .unwrap()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn synth(dir: &Path) {
    let out = data(&[
        "synth",
        "--out",
        dir.to_str().unwrap(),
        "--classes",
        "2",
        "--images",
        "6",
        "--seed",
        "3",
    ]);
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn verify_passes_a_good_set_and_fails_a_damaged_one_naming_shard_and_record() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path());
    let ok = data(&["verify", dir.path().to_str().unwrap()]);
    assert!(ok.status.success(), "{}", text(&ok));
    assert_eq!(text(&ok).matches("OK ").count(), 2, "{}", text(&ok));

    let shard = dir.path().join("train/shard-00000.rdl");
    let mut bytes = fs::read(&shard).unwrap();
    bytes[4096 + 500] ^= 0xFF; // inside record 0
    fs::write(&shard, bytes).unwrap();
    let bad = data(&["verify", dir.path().join("train").to_str().unwrap()]);
    assert_eq!(bad.status.code(), Some(1));
    let message = text(&bad);
    assert!(
        message.contains("shard-00000.rdl: record 0: CRC32C mismatch"),
        "{message}"
    );
}

#[test]
fn inspect_shows_counts_classes_and_records() {
    let dir = tempfile::tempdir().unwrap();
    synth(dir.path());
    let out = data(&["inspect", dir.path().to_str().unwrap(), "--records", "2"]);
    assert!(out.status.success(), "{}", text(&out));
    let shown = text(&out);
    for expected in [
        "records: 6",
        "records: 2",
        "c000_000deg: 3",
        "record 1: shard-00000.rdl#1 Jpeg",
    ] {
        assert!(
            shown.contains(expected),
            "missing {expected:?} in:\n{shown}"
        );
    }
}

#[test]
fn bad_arguments_and_missing_sets_exit_non_zero_with_a_message() {
    let out = data(&["verify", "/nonexistent/set"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("/nonexistent/set"), "{}", text(&out));
    let out = data(&["synth", "--out", "/tmp/x", "--classes", "0"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("at least one class"), "{}", text(&out));
    let out = data(&[
        "build",
        "--from-folder",
        "/nonexistent/tree",
        "--out",
        "/tmp/y",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("/nonexistent/tree"), "{}", text(&out));
}
