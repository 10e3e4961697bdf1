//! `cargo xtask train`: real training with evaluation and checkpoints every epoch (the
//! `redline-train` command of the `redline` crate), on shards or an ImageFolder tree.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;

use crate::run;

#[derive(Args)]
pub struct TrainArgs {
    /// Shards with `train/` and `val/`, or an ImageFolder tree with `train/` and `val/`
    /// (converted once, cached under target/).
    #[arg(long)]
    data: PathBuf,
    /// resnet18, resnet34 or resnet50.
    #[arg(long, default_value = "resnet18")]
    model: String,
    /// Final training (and evaluation) resolution.
    #[arg(long, default_value_t = 64)]
    res: usize,
    /// Progressive resizing starts here (FFCV's recipe); default: no resizing.
    #[arg(long)]
    min_res: Option<usize>,
    #[arg(long, default_value_t = 64)]
    batch: usize,
    #[arg(long, default_value_t = 8)]
    epochs: usize,
    /// Peak learning rate of the one-cycle schedule (default 0.2 × batch × processes ×
    /// accumulate / 64).
    #[arg(long)]
    lr: Option<f64>,
    /// fp32, fp16 or bf16 (default: fp16 on a GPU, fp32 on the CPU).
    #[arg(long, value_parser = ["fp32", "fp16", "bf16"])]
    precision: Option<String>,
    /// cpu, wgpu, `wgpu:<adapter>` (default: the registry's best device).
    #[arg(long)]
    device: Option<String>,
    /// Continue from a checkpoint this command wrote.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Where checkpoints go (default target/train-checkpoints).
    #[arg(long)]
    checkpoints: Option<PathBuf>,
    /// A JSON report with `final_val_top1` (0..1) and every epoch's figures.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Data parallel on this machine: start N processes (torchrun's variables set, the cores
    /// shared out among them); `--batch` is per process. Each takes `cuda:{rank}` on a
    /// machine with GPUs.
    #[arg(long, default_value_t = 1)]
    nproc: usize,
    /// With --nproc: batch norm statistics over every process's batch (synchronised).
    #[arg(long)]
    sync_bn: bool,
    /// With --nproc: gradients averaged in buckets of this many MiB (DDP's bucket_cap_mb).
    #[arg(long)]
    bucket_mb: Option<f64>,
    /// Replay the training step as a captured CUDA graph after a warm-up.
    #[arg(long)]
    graph: bool,
    /// Gradient accumulation: one optimizer step per K batches.
    #[arg(long, default_value_t = 1)]
    accumulate: usize,
    /// The port rank 0 serves the rendezvous on (with --nproc).
    #[arg(long, default_value_t = 29500)]
    master_port: u16,
}

pub fn run(args: TrainArgs) -> Result<()> {
    let work = run::target_dir().join("train-data");
    let shards = crate::data::shards(&args.data, &work)?;
    for split in ["train", "val"] {
        if !shards.join(split).join("manifest.json").exists() {
            bail!(
                "--data {}: needs {split}/ (a shard set, or an ImageFolder split)",
                args.data.display()
            );
        }
    }
    let features: Vec<&str> = run::fast_decoder()
        .map(|f| vec!["--features", f])
        .unwrap_or_default();
    let checkpoints = args
        .checkpoints
        .clone()
        .unwrap_or_else(|| run::target_dir().join("train-checkpoints"));
    let mut flags: Vec<std::ffi::OsString> = vec!["--data".into(), shards.into()];
    flags.extend(["--checkpoints".into(), checkpoints.into()]);
    let options = [
        ("--model", Some(args.model.clone())),
        ("--res", Some(args.res.to_string())),
        ("--min-res", args.min_res.map(|v| v.to_string())),
        ("--batch", Some(args.batch.to_string())),
        ("--epochs", Some(args.epochs.to_string())),
        ("--lr", args.lr.map(|v| v.to_string())),
        ("--precision", args.precision.clone()),
        ("--device", args.device.clone()),
        ("--accumulate", Some(args.accumulate.to_string())),
        ("--bucket-mb", args.bucket_mb.map(|v| v.to_string())),
    ];
    for (flag, value) in options {
        if let Some(v) = value {
            flags.extend([flag.into(), v.into()]);
        }
    }
    if let Some(p) = &args.resume {
        flags.extend(["--resume".into(), p.into()]);
    }
    if let Some(p) = &args.json {
        flags.extend(["--json".into(), p.into()]);
    }
    if args.sync_bn {
        flags.push("--sync-bn".into());
    }
    if args.graph {
        flags.push("--graph".into());
    }
    if args.nproc <= 1 {
        let mut cmd = run::cargo();
        cmd.args(["run", "--release", "--quiet", "--package", "redline"])
            .args(&features)
            .args(["--bin", "redline-train", "--"])
            .args(&flags);
        return run::check(&mut cmd);
    }
    let mut build = run::cargo();
    build
        .args(["build", "--release", "--quiet", "--package", "redline"])
        .args(&features)
        .args(["--bin", "redline-train"]);
    run::check(&mut build)?;
    let binary = run::target_dir().join("release/redline-train");
    processes(&binary, &flags, args.nproc, args.master_port)
}

/// Starts `n` ranks of `binary`, each with an equal share of the cores for its backend and its
/// loader.
fn processes(
    binary: &std::path::Path,
    flags: &[std::ffi::OsString],
    n: usize,
    port: u16,
) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let share = (cores / n).max(1).to_string();
    run::local_ranks(n, port, |_| {
        let mut cmd = std::process::Command::new(binary);
        cmd.args(flags)
            .args(["--workers", &share])
            .env("REDLINE_CPU_THREADS", &share);
        cmd
    })
}
