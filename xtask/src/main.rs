//! `cargo xtask`: the project's one entry point for tests, data and benchmarks.
//!
//! It stays thin — it runs cargo and the project's own binaries and reads their output — so it
//! builds in seconds and never drags heavy dependencies into the build.

mod bench;
mod data;
mod doctor;
mod gpu_check;
mod imagenet;
mod mutations;
mod run;
mod test;
mod train;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Build, test and benchmark redline",
    version
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// THE test command (what CI runs): fmt, clippy, cargo test, the format-spec check, then the
    /// hardware suites where their hardware is present.
    Test(test::TestArgs),
    /// Dataset shards: `build`, `synth`, `verify`, `inspect` (run `cargo xtask shards help`).
    #[command(disable_help_flag = true)]
    Shards {
        /// Passed to `redline-data`; `cargo xtask shards build --help` shows its options.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Benchmarks.
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Which of the four reasons a GPU idles holds in a run (data, launches, memory access,
    /// synchronisation), with the evidence and the fix: reads a bench or train JSON, or with
    /// `--run` measures a short `bench imagenet` with `--profile-ops` first.
    Doctor(doctor::DoctorArgs),
    /// Build the self-contained GPU check pack (`--pack DIR`) for a machine with an NVIDIA GPU.
    GpuCheck(gpu_check::GpuCheckArgs),
    /// Plant known bugs in copies of the CUDA kernels and check the host-emulated suite fails on
    /// each (also a phase of `test`).
    KernelMutations,
    /// Train a ResNet with evaluation and checkpoints every epoch (`--data` required).
    Train(train::TrainArgs),
    /// Write a checkpoint's model weights alone (`--checkpoint CKPT --out MODEL.safetensors`),
    /// loadable by `safetensors.torch.load_file` into torchvision's ResNet.
    Export {
        #[arg(long)]
        checkpoint: std::path::PathBuf,
        #[arg(long)]
        out: std::path::PathBuf,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Test(args) => test::run(args),
        Command::Shards { args } => run::data_tool(&args, run::Profile::Release),
        Command::Bench(bench) => bench::run(bench),
        Command::Train(args) => train::run(args),
        Command::GpuCheck(args) => gpu_check::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::KernelMutations => mutations::run().map(|note| println!("{note}")),
        Command::Export { checkpoint, out } => run::check(
            run::cargo()
                .args(["run", "--release", "--quiet", "--package", "redline"])
                .args(["--bin", "redline-export", "--", "--checkpoint"])
                .arg(&checkpoint)
                .arg("--out")
                .arg(&out),
        ),
    }
}
