//! What a user sees on stderr: on a normal run no line that starts with "error" (the GPU probe
//! once printed Wayland's "error: XDG_RUNTIME_DIR is invalid or not set" twice on a headless
//! machine), while a real error still reaches stderr.

use std::process::Command;

fn redline_train(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_redline-train"))
        .args(args)
        // A headless machine's environment: no Wayland session.
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("WAYLAND_DISPLAY")
        .env_remove("DISPLAY")
        .output()
        .expect("redline-train runs")
}

#[test]
fn probing_the_devices_prints_no_error_lines() {
    let out = redline_train(&["--list-devices"]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.lines().any(|l| l == "cpu"), "{stdout}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.trim_start().to_lowercase().starts_with("error"))
        .collect();
    assert!(errors.is_empty(), "stray error lines: {errors:?}");
}

#[test]
fn a_real_error_reaches_stderr_and_fails() {
    let out = redline_train(&["--data", "/nonexistent/redline-data"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("redline-train:") && stderr.contains("/nonexistent/redline-data"),
        "{stderr}"
    );
}

#[test]
fn a_mistyped_or_malformed_argument_is_refused_naming_it() {
    // `--epoch` for `--epochs`: refused, not silently ignored with the default 8 epochs.
    let out = redline_train(&["--data", "/nonexistent/redline-data", "--epoch", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--epoch"), "{stderr}");
    let out = redline_train(&["--data", "/x", "--batch", "many"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--batch") && stderr.contains("many"),
        "{stderr}"
    );
    let out = redline_train(&["--data", "/x", "--precision", "fp8"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("fp8") && stderr.contains("bf16"),
        "{stderr}"
    );
    // Without --data (and not listing devices) it says what is required.
    let out = redline_train(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--data"), "{stderr}");
}

#[test]
fn help_lists_every_option_with_its_default() {
    let out = redline_train(&["--help"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for option in [
        "--data",
        "--model",
        "--res",
        "--min-res",
        "--batch",
        "--epochs",
        "--lr",
        "--wd",
        "--precision",
        "--device",
        "--workers",
        "--seed",
        "--resume",
        "--checkpoints",
        "--json",
        "--list-devices",
    ] {
        assert!(stdout.contains(option), "{option} missing from:\n{stdout}");
    }
    assert!(stdout.contains("[default: 64]"), "{stdout}");
}

#[test]
fn redline_export_refuses_missing_arguments_and_names_a_bad_checkpoint() {
    let export = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_redline-export"))
            .args(args)
            .output()
            .expect("redline-export runs")
    };
    let out = export(&["--checkpoint", "a.safetensors"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--out"));
    let out = export(&[
        "--checkpoint",
        "/nonexistent/c.safetensors",
        "--out",
        "/tmp/w",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("/nonexistent/c.safetensors"), "{stderr}");
}
