//! `redline-train --data DIR [--model resnet18|34|50] [--res R] [--min-res R] [--batch B]
//! [--epochs E] [--lr LR] [--wd WD] [--precision fp32|fp16|bf16] [--device NAME]
//! [--workers N] [--seed S] [--resume CKPT] [--checkpoints DIR] [--json PATH] [--sync-bn]
//! [--bucket-mb MB] [--graph] [--accumulate K]` (or
//! `redline-train --list-devices`, best first): real
//! training on `DIR/train` with evaluation on `DIR/val` after every epoch and a checkpoint
//! after every epoch (`cargo xtask train` converts an ImageFolder tree first and drives it).
//!
//! The default recipe needs no tuning on a small dataset: SGD with Nesterov momentum 0.9,
//! weight decay 5e-5 on weights only, a one-cycle learning rate peaking at `--lr` (0.2 ×
//! batch/64), label smoothing 0.1, and FFCV's progressive resizing from `--min-res` to `--res`
//! over the last part of training.
//!
//! Data parallel: started as several processes with torchrun's variables (RANK, WORLD_SIZE,
//! LOCAL_RANK, MASTER_ADDR, MASTER_PORT — `torchrun --no-python`, `srun`, or
//! `cargo xtask train --nproc N`), each process trains on its shard of the data with `--batch`
//! images per step (the global batch is `--batch × WORLD_SIZE`, and the default learning rate
//! follows it), gradients are averaged across processes during backward, evaluation is
//! sharded (each validation image on one process, the figures summed), and rank 0 alone
//! prints progress and writes checkpoints and the report. An epoch's checkpoint (at the next
//! epoch's start) resumes on any number of processes with the data order unchanged and the
//! schedule going on from the same share of training, given the same `--seed`.

use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use redline::registry::{self, Kind};
use redline_dist::Launch;
use redline_loader::{Config, Loader, Mode, Position, Uneven};
use redline_nn::{decay_groups, ResNet, ResNetConfig, Schedule, Sgd};
use redline_shard::ShardSet;
use redline_tensor::PendingVec;
use redline_train::profile::{memory_json, stream_bandwidth, OpProfile, StepProfile};
use redline_train::{progressive_res, Precision, Summary, TrainConfig, Trainer};
use serde_json::json;

type Res<T> = Result<T, Box<dyn Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("redline-train: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Trains a ResNet on shards with evaluation and a checkpoint after every epoch.
#[derive(Parser)]
#[command(name = "redline-train")]
struct Cli {
    /// Shards with train/ and val/ (`cargo xtask train` converts an ImageFolder tree first).
    #[arg(long, required_unless_present = "list_devices")]
    data: Option<PathBuf>,
    /// Print the devices this machine has, best first, and exit.
    #[arg(long)]
    list_devices: bool,
    /// resnet18, resnet34 or resnet50.
    #[arg(long, default_value = "resnet18")]
    model: String,
    /// Final training resolution (and the evaluation resolution).
    #[arg(long, default_value_t = 64)]
    res: usize,
    /// Starting resolution of the progressive ramp [default: --res].
    #[arg(long)]
    min_res: Option<usize>,
    #[arg(long, default_value_t = 64)]
    batch: usize,
    #[arg(long, default_value_t = 8)]
    epochs: usize,
    /// Peak learning rate of the one-cycle schedule [default: 0.2 × the images a step sees
    /// (batch × processes × --accumulate) / 64].
    #[arg(long)]
    lr: Option<f64>,
    /// Weight decay (weights only).
    #[arg(long, default_value_t = 5e-5)]
    wd: f64,
    /// Training precision [default: fp32 on the CPU, fp16 elsewhere].
    #[arg(long, value_parser = ["fp32", "fp16", "bf16"])]
    precision: Option<String>,
    /// A device by name (`--list-devices`) [default: the best one].
    #[arg(long)]
    device: Option<String>,
    /// Loader threads [default: every core].
    #[arg(long)]
    workers: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Continue from this checkpoint.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Where the checkpoint of every epoch goes.
    #[arg(long, default_value = "checkpoints")]
    checkpoints: PathBuf,
    /// Write the run's report (history, final top-1/top-5) as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Data parallel: batch norm statistics over every process's batch (synchronised batch
    /// norm) instead of each process's own.
    #[arg(long)]
    sync_bn: bool,
    /// Replay the training step as a captured CUDA graph after a warm-up (one launch a step;
    /// captured again when progressive resizing changes the resolution). Elsewhere the steps
    /// run eagerly and the report's `graph` says why.
    #[arg(long)]
    graph: bool,
    /// Data parallel: gradients are averaged in buckets of this many MiB, each started as soon
    /// as backward has produced its gradients (DDP's `bucket_cap_mb`).
    #[arg(long, default_value_t = 25.0, allow_negative_numbers = true)]
    bucket_mb: f64,
    /// Gradient accumulation: one optimizer step per K batches (effective batch K × --batch;
    /// a data-parallel job reduces once per step). An epoch's last batches that do not fill a
    /// step are skipped.
    #[arg(long, default_value_t = 1)]
    accumulate: usize,
}

fn open(dir: &Path) -> Res<Arc<ShardSet>> {
    Ok(Arc::new(
        ShardSet::open(dir).map_err(|e| format!("{}: {e}", dir.display()))?,
    ))
}

fn run() -> Res<()> {
    let cli = Cli::parse();
    if cli.list_devices {
        for c in registry::candidates() {
            let software = if c.software { " (software)" } else { "" };
            println!("{}{software}", c.name);
        }
        return Ok(());
    }
    let data = cli
        .data
        .ok_or("--data DIR (with train/ and val/) is required")?;
    let (train, val) = (open(&data.join("train"))?, open(&data.join("val"))?);
    let launch = Launch::from_env()?.unwrap_or_else(Launch::single);
    let (rank, world) = (launch.rank, launch.world);
    let lead = rank == 0;
    // One device per process: a rank of a job on a CUDA machine takes `cuda:{LOCAL_RANK}`.
    let name = match (&cli.device, world > 1) {
        (None, true) => registry::for_local_rank(launch.local_rank, &registry::candidates())?,
        (name, _) => name.clone(),
    };
    let (candidate, device) = registry::select(name.as_deref())?;
    // Each epoch's steps are summarised in the report with their ops counted by kind, so
    // `cargo xtask doctor` can read a training run as it reads a bench.
    let synchronous = candidate.kind == Kind::Cpu;
    let stream_gb_per_s = stream_bandwidth(&device, 64 << 20)?;
    let (device, profile) = OpProfile::wrap(device, false);
    let model_name = cli.model;
    let (res, batch, epochs, wd, seed) = (cli.res, cli.batch, cli.epochs, cli.wd, cli.seed);
    let min_res = cli.min_res.unwrap_or(res);
    // Scaled with the images an optimizer step sees: every rank's batches, accumulated.
    let lr = (cli.lr).unwrap_or(0.2 * (batch * world * cli.accumulate.max(1)) as f64 / 64.0);
    let workers = cli
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let precision: Precision = match cli.precision {
        Some(p) => p.parse()?,
        None if candidate.kind == Kind::Cpu => Precision::Fp32,
        None => Precision::Fp16,
    };
    let checkpoints = cli.checkpoints.clone();
    if epochs == 0 || batch == 0 {
        return Err("--epochs and --batch must be at least 1".into());
    }
    let bucket_bytes = (cli.bucket_mb * (1 << 20) as f64).round();
    if !(bucket_bytes >= 1.0 && bucket_bytes.is_finite()) {
        return Err(format!(
            "--bucket-mb {}: a bucket needs at least a byte",
            cli.bucket_mb
        )
        .into());
    }

    let classes = train.classes().len().max(1);
    let mut config = ResNetConfig::named(&model_name)?;
    config.num_classes = classes;
    config.seed = seed;
    config.zero_init_residual = true;
    let model = ResNet::new(config, &device)?;
    let sgd = Sgd::new(decay_groups(&model, wd), 0.9, 0.0, true)?;
    // Each rank reads its shard: training batches padded to the same count on every rank,
    // evaluation each sample exactly once (the trainer sums the figures over the ranks).
    let loader_config = |res: usize, train: bool| Config {
        workers,
        seed,
        allocator: device.host_allocator(),
        rank,
        world,
        uneven: if train { Uneven::Pad } else { Uneven::Exact },
        ..Config::new(batch, res, train)
    };
    let per_epoch = Loader::new(train.clone(), loader_config(res, true), Position::default())?
        .batches_per_epoch();
    if per_epoch == 0 {
        return Err(format!(
            "{} has fewer images than one batch of {batch}",
            data.display()
        )
        .into());
    }
    let accumulate = cli.accumulate;
    if accumulate == 0 || accumulate > per_epoch {
        return Err(format!(
            "--accumulate {accumulate}: between 1 and the {per_epoch} batches of an epoch"
        )
        .into());
    }
    // Optimizer steps per epoch.
    let steps_per_epoch = per_epoch / accumulate;
    let total = epochs * steps_per_epoch;
    let recipe = TrainConfig {
        precision,
        label_smoothing: 0.1,
        clip_norm: None,
        base_lr: lr,
        schedule: Schedule::one_cycle(total),
    };
    let mut trainer = Trainer::new(Box::new(model), Box::new(sgd), recipe, device.clone())?
        .with_accumulation(accumulate)?;
    if cli.graph {
        trainer = trainer.with_graph();
    }
    if world > 1 {
        let collective =
            redline_dist::connect_device(&launch, &device, redline_dist::timeout_from_env()?)?;
        trainer = trainer.with_data_parallel(collective, bucket_bytes as usize)?;
        if cli.sync_bn {
            trainer = trainer.with_sync_batch_norm()?;
        }
        if lead {
            let over = match device.name().starts_with("cuda:") {
                true => redline_dist::NcclCollective::describe(),
                false => "the CPU collective (TCP)".to_string(),
            };
            eprintln!("redline-train: rank 0 of {world} (data parallel over {over}, batch {batch} per rank)");
        }
    }
    if let Some(ckpt) = &cli.resume {
        let progress = trainer.load_resharded(ckpt, Mode::Random)?;
        if progress.seed != seed {
            return Err(format!(
                "{}: trained with --seed {}, and this run has --seed {seed}: the data order \
                 would change (pass --seed {} to continue it)",
                ckpt.display(),
                progress.seed,
                progress.seed
            )
            .into());
        }
        eprintln!(
            "resumed {}: step {}, epoch {}, sample {}",
            ckpt.display(),
            progress.step,
            progress.epoch,
            progress.index
        );
        // The schedule goes on from the share of training done, in this job's steps (another
        // world size takes another number of steps per epoch).
        let here = progress.epoch as usize * steps_per_epoch
            + progress.index as usize / batch / accumulate;
        if here != trainer.steps() {
            trainer.set_steps(here);
            if lead {
                eprintln!(
                    "  the schedule continues at step {here} of {total} ({steps_per_epoch} \
                     steps per epoch on {world} process(es))"
                );
            }
        }
    }
    // FFCV's ramp: the last ~30% of training, ending one epoch before the end.
    let (ramp_start, ramp_end) = ((epochs * 6) / 10, epochs.saturating_sub(1).max(1));
    if lead {
        eprintln!(
            "redline-train: {model_name} ({classes} classes) on {}, {precision}, batch {batch}, \
         {epochs} epochs × {steps_per_epoch} steps of {accumulate} batch(es), lr {lr} one-cycle, res {min_res}→{res}",
            device.name()
        );
    }
    let mut history = Vec::new();
    let started = Instant::now();
    loop {
        // Where this epoch starts: a position with fewer batches left in its epoch than a step
        // takes is the next epoch's start.
        let at = trainer.position();
        let done_batches = at.index / batch;
        let (epoch, first) = if done_batches + accumulate > per_epoch {
            (at.epoch as usize + 1, 0)
        } else {
            (at.epoch as usize, done_batches)
        };
        if epoch >= epochs || trainer.steps() >= total {
            break;
        }
        let epoch_res = progressive_res(epoch, ramp_start, ramp_end, min_res, res);
        let start = Position {
            epoch: epoch as u64,
            index: first * batch,
        };
        let mut loader = Loader::new(train.clone(), loader_config(epoch_res, true), start)?;
        let (t0, mut images, mut loss_sum, mut losses) = (Instant::now(), 0, 0.0, 0);
        let mut times = Vec::new();
        profile.reset();
        // After the epoch's first step (a new resolution's first step fills the cache).
        let mut memory_before = None;
        // Every tenth step's loss, read asynchronously when the next one is taken: no step
        // waits for the device (phase times also arrive a few steps late).
        let mut loss_in_flight: Option<PendingVec<f32>> = None;
        for done in (first..=per_epoch - accumulate).step_by(accumulate) {
            let step = trainer.train_step(&mut loader)?;
            times.extend(step.times);
            if done == first {
                device.synchronize()?;
                memory_before = device.memory_stats();
            }
            images += step.images;
            if trainer.steps() % 10 == 0 {
                if let Some(loss) = loss_in_flight.replace(step.loss.to_vec_async()?) {
                    loss_sum += loss.wait()?.first().map_or(f64::NAN, |&l| f64::from(l));
                    losses += 1;
                }
                if lead {
                    eprint!(
                        "\r  epoch {epoch} step {:>5}/{total}  loss {:.3}  lr {:.4}  {:.1} img/s  ",
                        trainer.steps(),
                        loss_sum / losses as f64,
                        step.lr,
                        images as f64 / t0.elapsed().as_secs_f64()
                    );
                }
            }
        }
        times.extend(trainer.take_times()?);
        // The epoch's checkpoint resumes at the next epoch's start, on any number of processes.
        trainer.end_epoch();
        if lead {
            eprintln!();
        }
        let ops = StepProfile::new(&profile.rows(), times.len(), synchronous, false, false);
        let mut steps = Summary::new(&times, batch * accumulate).to_json();
        steps["resolution"] = json!(epoch_res);
        steps["stream_gb_per_s"] = json!(stream_gb_per_s);
        steps["ops"] = ops.to_json();
        device.synchronize()?;
        let after_first = times.len().saturating_sub(1);
        steps["device_memory"] = memory_json(memory_before, device.memory_stats(), after_first);
        let mut val_loader =
            Loader::new(val.clone(), loader_config(res, false), Position::default())?;
        let n = val_loader.batches_per_epoch();
        let eval = trainer.evaluate(&mut val_loader.by_ref().take(n))?;
        if lead {
            eprintln!(
            "  epoch {epoch}: val loss {:.3}, top-1 {:.3}, top-5 {:.3} ({} images, {epoch_res}px train)",
            eval.loss, eval.top1, eval.top5, eval.images
        );
        }
        let ckpt = checkpoints.join(format!("epoch{epoch}.safetensors"));
        if lead {
            trainer.save(&ckpt, seed)?;
        }
        history.push(json!({
            "epoch": epoch, "train_res": epoch_res, "train_images_per_sec":
                images as f64 / t0.elapsed().as_secs_f64(),
            "val_loss": eval.loss, "val_top1": eval.top1, "val_top5": eval.top5,
            "checkpoint": ckpt.display().to_string(), "steps": steps,
        }));
    }
    let last = history.last().cloned().unwrap_or_default();
    let report = json!({
        "device": device.name(), "device_kind": format!("{:?}", candidate.kind).to_lowercase(),
        "workers": workers, "world": world, "decoder": redline_loader::Codec::best().name(), "model": model_name, "precision": precision.to_string(),
        "batch": batch, "accumulate": accumulate, "epochs": epochs, "lr": lr, "resolution": res, "min_resolution": min_res,
        "final_val_top1": last["val_top1"], "final_val_top5": last["val_top5"],
        "seconds": started.elapsed().as_secs_f64(), "history": history,
        "graph": trainer.graph_stats().to_json(),
        "data_parallel": trainer.data_parallel().map(|r| json!({
            "bucket_bytes": bucket_bytes as usize, "buckets": r.buckets().len(),
        })),
    });
    if !lead {
        return Ok(());
    }
    if let Some(path) = &cli.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
        eprintln!("wrote {}", path.display());
    }
    println!(
        "final val top-1 {:.3}",
        report["final_val_top1"].as_f64().unwrap_or(f64::NAN)
    );
    Ok(())
}
