//! `redline-gpu-check [--json PATH] [--cases N] [--steps N] [--batch N] [--res N] [--model M]
//! [--graph] [--speed-steps N] [--speed-batch N] [--speed-warmup N] [--speed-profile-steps N]
//! [--vs-compile]
//! [--nproc N] [--scale-steps N] [--scale-batch N] [--scale-eager] [--emulate]` on a GPU machine (`--emulate`:
//! on the host emulator instead); `redline-gpu-check prepare DIR` where the pack is built;
//! `redline-gpu-check scale-rank …` is one rank of the scaling stage's jobs (started by it).
//! See the library docs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use redline_gpu_check::scaling::{RankOptions, ScaleOptions};
use redline_gpu_check::speed::SpeedOptions;
use redline_gpu_check::Options;
use redline_train::Precision;

/// Proves the CUDA backend on GPU 0: device and libraries, conformance, AMP, our own kernels,
/// wgpu on the NVIDIA adapter and a training run, with a JSON report written as it goes.
#[derive(Parser)]
// run.sh passes `--json gpu-check.json` before the user's arguments: a later --json wins.
#[command(
    name = "redline-gpu-check",
    args_conflicts_with_subcommands = true,
    args_override_self = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// The JSON report, rewritten after every stage.
    #[arg(long, default_value_os_t = Options::default().json)]
    json: PathBuf,
    /// Conformance cases per declared pair.
    #[arg(long, default_value_t = Options::default().cases)]
    cases: u32,
    /// Measured training steps after two warm-up steps; 0 skips the stage.
    #[arg(long, default_value_t = Options::default().steps)]
    steps: usize,
    /// Training batch.
    #[arg(long, default_value_t = Options::default().batch)]
    batch: usize,
    /// Training resolution.
    #[arg(long, default_value_t = Options::default().res)]
    res: usize,
    /// Training model (resnet18, resnet34 or resnet50).
    #[arg(long, default_value_t = Options::default().model)]
    model: String,
    /// Run on the host emulator instead of GPU 0 (the stages' own test, without a GPU).
    #[arg(long)]
    emulate: bool,
    /// Train by replaying the step as a captured CUDA graph after the warm-up.
    #[arg(long)]
    graph: bool,
    /// Measured steps of the speed stage (ResNet-50 beside PyTorch); 0 skips it.
    #[arg(long, default_value_t = SpeedOptions::default().steps)]
    speed_steps: usize,
    /// The speed stage's batch (both sides).
    #[arg(long, default_value_t = SpeedOptions::default().batch)]
    speed_batch: usize,
    /// The speed stage's precision (both sides): bf16, or fp16 with a GradScaler on both.
    #[arg(long, default_value = "bf16", value_parser = half_precision)]
    speed_precision: Precision,
    /// The speed stage's warm-up steps (both sides).
    #[arg(long, default_value_t = SpeedOptions::default().warmup)]
    speed_warmup: usize,
    /// Eager steps of ours the speed stage times op by op (device time per op, for the
    /// doctor's memory-access finding); 0 skips the profile.
    #[arg(long, default_value_t = SpeedOptions::default().profile_steps)]
    speed_profile_steps: usize,
    /// PyTorch's side of the speed stage under torch.compile too (adds its compile time).
    #[arg(long)]
    vs_compile: bool,
    /// Data-parallel scaling over N GPUs of this machine (one process each, NCCL) next to one
    /// GPU, as stage 10; 1 skips it.
    #[arg(long, default_value_t = 1)]
    nproc: usize,
    /// Measured steps of each scaling job (after its warm-up).
    #[arg(long, default_value_t = RankOptions::default().steps)]
    scale_steps: usize,
    /// The scaling stage's batch per GPU.
    #[arg(long, default_value_t = RankOptions::default().batch)]
    scale_batch: usize,
    /// The longest each scaling job may take, in seconds.
    #[arg(long, default_value_t = 300)]
    scale_timeout: u64,
    /// The scaling stage's steps run eagerly (on both sides) instead of replaying a graph.
    #[arg(long)]
    scale_eager: bool,
    /// Stages to leave out, by name, comma-separated (the device report always runs).
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(redline_gpu_check::STAGES))]
    skip: Vec<String>,
    /// The longest one stage may run, in seconds: past it the process ends (exit code 124)
    /// with the stage marked as timed out in the JSON.
    #[arg(long, default_value_t = Options::default().stage_timeout.as_secs())]
    stage_timeout: u64,
}

/// `--speed-precision`: an AMP precision (the speed stage compares mixed-precision steps).
fn half_precision(s: &str) -> Result<Precision, String> {
    match s {
        "bf16" => Ok(Precision::Bf16),
        "fp16" => Ok(Precision::Fp16),
        other => Err(format!(
            "{other:?}: the speed stage runs bf16 or fp16 autocast"
        )),
    }
}

#[derive(Subcommand)]
enum Command {
    /// Compile every kernel to CUBINs in DIR (where the pack is built).
    Prepare { dir: PathBuf },
    /// One rank of a scaling job (torchrun's variables place it): prints its JSON report.
    ScaleRank(RankOptions),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Prepare { dir }) => {
            return match redline_gpu_check::prepare(&dir) {
                Ok(n) => {
                    eprintln!("wrote {n} CUBINs into {}", dir.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("redline-gpu-check prepare: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        Some(Command::ScaleRank(options)) => {
            return match redline_gpu_check::scaling::rank(&options) {
                Ok(report) => {
                    println!("{report}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("redline-gpu-check scale-rank: {e}");
                    ExitCode::FAILURE
                }
            };
        }
        None => {}
    }
    let scaling = match cli.nproc > 1 {
        true => match std::env::current_exe() {
            Ok(binary) => Some(ScaleOptions {
                nproc: cli.nproc,
                rank: RankOptions {
                    batch: cli.scale_batch,
                    steps: cli.scale_steps,
                    eager: cli.scale_eager,
                    ..RankOptions::default()
                },
                binary,
                timeout: std::time::Duration::from_secs(cli.scale_timeout),
            }),
            Err(e) => {
                eprintln!("redline-gpu-check: where this executable is: {e}");
                return ExitCode::FAILURE;
            }
        },
        false => None,
    };
    let options = Options {
        json: cli.json,
        cases: cli.cases,
        steps: cli.steps,
        batch: cli.batch,
        res: cli.res,
        model: cli.model,
        emulate: cli.emulate,
        graph: cli.graph,
        speed: SpeedOptions {
            steps: cli.speed_steps,
            batch: cli.speed_batch,
            precision: cli.speed_precision,
            warmup: cli.speed_warmup,
            profile_steps: cli.speed_profile_steps,
            vs_compile: cli.vs_compile,
            ..SpeedOptions::default()
        },
        scaling,
        skip: cli.skip,
        stage_timeout: std::time::Duration::from_secs(cli.stage_timeout),
        ..Options::default()
    };
    if redline_gpu_check::run(&options) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
