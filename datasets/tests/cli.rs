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

/// Every file under `dir`, by path relative to it, with its bytes.
fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let name = path.strip_prefix(dir).unwrap().display().to_string();
                files.push((name, fs::read(&path).unwrap()));
            }
        }
    }
    files.sort();
    files
}

/// Shards finished so far by the build writing `set`, from its journal (0 before it exists or
/// while it is being replaced).
fn shards_finished(set: &Path) -> usize {
    fs::read(set.join("build.json"))
        .ok()
        .and_then(|text| serde_json::from_slice::<serde_json::Value>(&text).ok())
        .and_then(|journal| journal["shards"].as_array().map(Vec::len))
        .unwrap_or(0)
}

#[test]
fn a_build_killed_in_the_middle_resumes_and_writes_the_same_shard_set() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    let out = data(&[
        "synth",
        "--out",
        src.to_str().unwrap(),
        "--folder",
        "--classes",
        "3",
        "--images",
        "120",
        "--seed",
        "7",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let build = |to: &Path| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_redline-data"));
        command.args(["build", "--from-folder", src.to_str().unwrap(), "--out"]);
        command.arg(to);
        // Small shards (about 14 images each) so the kill lands between many of them; one
        // thread so the build lasts long enough to be killed part-way.
        command.args([
            "--max-side",
            "64",
            "--shard-size",
            "65536",
            "--threads",
            "1",
        ]);
        command
    };

    let whole = dir.path().join("whole");
    let out = build(&whole).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));

    let resumed = dir.path().join("resumed");
    let mut child = build(&resumed)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while shards_finished(&resumed.join("train")) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the build never finished two shards"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the build ended before it was killed"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap(); // SIGKILL: no destructor, no clean-up runs
    child.wait().unwrap();
    assert!(
        !resumed.join("train/manifest.json").exists(),
        "the kill came after the training set was complete"
    );

    let out = build(&resumed).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("train: resuming after"),
        "{}",
        text(&out)
    );
    assert_eq!(tree(&resumed), tree(&whole));

    // Once complete, the same build is a no-op, and another build is refused, not mixed in.
    let out = build(&resumed).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("nothing to do"), "{}", text(&out));
    assert_eq!(tree(&resumed), tree(&whole));
    let out = build(&resumed).args(["--quality", "70"]).output().unwrap();
    assert_eq!(out.status.code(), Some(3), "exit code 3: another build");
    assert!(
        text(&out).contains("other inputs or options") && text(&out).contains("build.json"),
        "{}",
        text(&out)
    );
    assert_eq!(tree(&resumed), tree(&whole));
}
