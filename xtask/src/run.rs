//! Running cargo and the project's binaries.

use std::path::PathBuf;
use std::process::{Command, ExitStatus};

use anyhow::{bail, Context, Result};

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map(PathBuf::from).unwrap_or(manifest)
}

/// The cargo target directory.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| if p.is_absolute() { p } else { root().join(p) })
        .unwrap_or_else(|| root().join("target"))
}

/// Whether `program` is an executable file in a folder of PATH.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            std::fs::metadata(dir.join(program)).is_ok_and(|m| {
                m.is_file()
                    && std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
            })
        })
    })
}

/// The feature that builds libjpeg-turbo (`turbojpeg`) when its build tools, cmake and nasm,
/// are on PATH; else none, and one line saying what is faster and how to get it.
pub fn fast_decoder() -> Option<&'static str> {
    let missing: Vec<&str> = ["cmake", "nasm"]
        .into_iter()
        .filter(|p| !on_path(p))
        .collect();
    if missing.is_empty() {
        return Some("turbojpeg");
    }
    eprintln!(
        "note: JPEGs decode with zune-jpeg (pure Rust); libjpeg-turbo's DCT-scaled crops are faster — install {} (e.g. `apt-get install cmake nasm`) to build it",
        missing.join(" and ")
    );
    None
}

/// `cargo` as the user invoked it.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(root());
    cmd
}

/// `cargo run --release` of one of `redline-benches`' binaries, with `features`, up to the
/// `--` after which its own arguments go.
pub fn bench_binary(bin: &str, features: &[&str]) -> Command {
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--release",
        "--quiet",
        "--package",
        "redline-benches",
    ])
    .args(["--bin", bin]);
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    cmd.arg("--");
    cmd
}

/// Runs `cmd`, echoing it first; returns its exit status.
pub fn status(cmd: &mut Command) -> Result<ExitStatus> {
    eprintln!("$ {}", describe(cmd));
    cmd.status()
        .with_context(|| format!("could not start `{}`", describe(cmd)))
}

/// Runs `cmd` and fails unless it succeeds.
pub fn check(cmd: &mut Command) -> Result<()> {
    let status = status(cmd)?;
    if !status.success() {
        bail!("`{}` failed ({status})", describe(cmd));
    }
    Ok(())
}

pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|s| s.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// Shares the test build (what `cargo xtask test` uses).
    Dev,
    /// What users get from `cargo xtask shards …`.
    Release,
}

/// Runs the `redline-data` tool (crate `redline-datasets`) with `args`.
pub fn data_tool(args: &[String], profile: Profile) -> Result<()> {
    let mut cmd = data_tool_command(profile);
    cmd.args(args);
    let status = status(&mut cmd)?;
    if !status.success() {
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}

pub fn data_tool_command(profile: Profile) -> Command {
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--quiet",
        "--package",
        "redline-datasets",
        "--bin",
        "redline-data",
    ]);
    if profile == Profile::Release {
        cmd.arg("--release");
    }
    cmd.arg("--");
    cmd
}

/// Runs `n` local ranks of a job as torchrun would: `command(rank)` for each, with RANK,
/// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (loopback) and MASTER_PORT set, and
/// waits for all of them. Every failure is reported with its rank (the others fail on their own
/// within the rendezvous timeout, each naming the rank it lost; none is killed).
pub fn local_ranks(n: usize, port: u16, command: impl Fn(usize) -> Command) -> Result<()> {
    let mut children = Vec::new();
    for rank in 0..n {
        let mut cmd = command(rank);
        cmd.env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string());
        eprintln!("$ RANK={rank} WORLD_SIZE={n} {}", describe(&cmd));
        let child = cmd
            .spawn()
            .with_context(|| format!("starting rank {rank}: {}", describe(&cmd)))?;
        children.push((rank, child));
    }
    let mut failed = Vec::new();
    for (rank, mut child) in children {
        let status = child.wait()?;
        if !status.success() {
            failed.push(format!("rank {rank}: {status}"));
        }
    }
    if !failed.is_empty() {
        bail!(
            "{} of {n} processes failed ({})",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}
