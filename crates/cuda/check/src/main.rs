//! `redline-gpu-check [--json PATH] [--cases N] [--steps N] [--batch N] [--res N] [--model M]
//! [--graph] [--speed-steps N] [--speed-batch N] [--speed-warmup N] [--vs-compile] [--emulate]`
//! on a GPU machine (`--emulate`: on the host emulator instead);
//! `redline-gpu-check prepare DIR` where the pack is built. See the library docs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use redline_gpu_check::speed::SpeedOptions;
use redline_gpu_check::Options;

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
    /// The speed stage's warm-up steps (both sides).
    #[arg(long, default_value_t = SpeedOptions::default().warmup)]
    speed_warmup: usize,
    /// PyTorch's side of the speed stage under torch.compile too (adds its compile time).
    #[arg(long)]
    vs_compile: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Compile every kernel to CUBINs in DIR (where the pack is built).
    Prepare { dir: PathBuf },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Prepare { dir }) = &cli.command {
        return match redline_gpu_check::prepare(dir) {
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
            warmup: cli.speed_warmup,
            vs_compile: cli.vs_compile,
            ..SpeedOptions::default()
        },
        ..Options::default()
    };
    if redline_gpu_check::run(&options) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
