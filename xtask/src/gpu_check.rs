//! `cargo xtask gpu-check --pack DIR`: builds, on a machine without a GPU, one self-contained
//! folder that proves the CUDA backend on any machine with an NVIDIA GPU — no cargo, no NVRTC,
//! no network there:
//! - `redline-gpu-check`, the stripped release binary (commit stamped in);
//! - `cubin/`, every kernel family compiled by NVRTC for every target architecture (so a GPU run
//!   pays no compile time);
//! - `pytorch/gpu_speed.py`, PyTorch's side of the speed stage (run with the machine's own
//!   PyTorch);
//! - `run.sh`, which runs the check and writes `gpu-check.json` beside it as it goes.
//!
//! The folder must stay under 40 MiB.

use std::fs;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::run;

#[derive(Args)]
pub struct GpuCheckArgs {
    /// The folder to write the pack into (made if missing).
    #[arg(long)]
    pack: PathBuf,
}

const LIMIT: u64 = 40 << 20;

const RUN_SH: &str = r#"#!/bin/sh
# Runs the CUDA backend's GPU check; writes gpu-check.json here as it goes.
# Extra arguments go to the check (e.g. --steps 20 --batch 32).
cd "$(dirname "$0")" || exit 1
# A copy may have lost the executable bit.
[ -x ./redline-gpu-check ] || chmod +x ./redline-gpu-check
exec ./redline-gpu-check --json gpu-check.json "$@"
"#;

pub fn run(args: GpuCheckArgs) -> Result<()> {
    let commit = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(run::root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let mut build = run::cargo();
    build
        .args(["build", "--release", "--package", "redline-gpu-check"])
        .env("REDLINE_COMMIT", &commit)
        // Stripping is a link step: the dependencies' release builds are reused.
        .env("CARGO_PROFILE_RELEASE_STRIP", "symbols");
    run::check(&mut build)?;
    let pack = &args.pack;
    fs::create_dir_all(pack).with_context(|| format!("creating {}", pack.display()))?;
    let binary = pack.join("redline-gpu-check");
    fs::copy(run::target_dir().join("release/redline-gpu-check"), &binary)
        .context("copying the binary")?;
    let cubins = pack.join("cubin");
    let _ = fs::remove_dir_all(&cubins);
    // A report from an earlier run of this folder must not travel with the new binary.
    let _ = fs::remove_file(pack.join("gpu-check.json"));
    run::check(Command::new(&binary).arg("prepare").arg(&cubins)).context(
        "compiling the CUBINs needs NVRTC here (pip install nvidia-cuda-nvrtc nvidia-cuda-runtime)",
    )?;
    let pytorch = pack.join("pytorch");
    fs::create_dir_all(&pytorch)?;
    fs::copy(
        run::root().join("benches/pytorch/gpu_speed.py"),
        pytorch.join("gpu_speed.py"),
    )
    .context("copying PyTorch's side of the speed stage")?;
    let script = pack.join("run.sh");
    fs::write(&script, RUN_SH)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755))?;
    }
    let size = dir_size(pack)?;
    eprintln!(
        "gpu-check pack in {} ({:.1} MiB, commit {commit}): copy it to a GPU machine and run ./run.sh",
        pack.display(),
        size as f64 / (1 << 20) as f64
    );
    if size > LIMIT {
        bail!("the pack is {size} bytes, over the 40 MiB it must fit in");
    }
    Ok(())
}

fn dir_size(dir: &std::path::Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            dir_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}
