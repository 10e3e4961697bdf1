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
    /// Peak learning rate of the one-cycle schedule (default 0.2 × batch/64).
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
    let mut cmd = run::cargo();
    cmd.args(["run", "--release", "--quiet", "--package", "redline"]);
    if let Some(feature) = run::fast_decoder() {
        cmd.args(["--features", feature]);
    }
    cmd.args(["--bin", "redline-train", "--"])
        .arg("--data")
        .arg(&shards);
    let checkpoints = args
        .checkpoints
        .clone()
        .unwrap_or_else(|| run::target_dir().join("train-checkpoints"));
    cmd.arg("--checkpoints").arg(checkpoints);
    let options = [
        ("--model", Some(args.model.clone())),
        ("--res", Some(args.res.to_string())),
        ("--min-res", args.min_res.map(|v| v.to_string())),
        ("--batch", Some(args.batch.to_string())),
        ("--epochs", Some(args.epochs.to_string())),
        ("--lr", args.lr.map(|v| v.to_string())),
        ("--precision", args.precision.clone()),
        ("--device", args.device.clone()),
    ];
    for (flag, value) in options {
        if let Some(v) = value {
            cmd.arg(flag).arg(v);
        }
    }
    if let Some(p) = &args.resume {
        cmd.arg("--resume").arg(p);
    }
    if let Some(p) = &args.json {
        cmd.arg("--json").arg(p);
    }
    run::check(&mut cmd)
}
