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
