//! `bench-imagenet --shards DIR --out PATH [--model resnet18|34|50] [--res R] [--batch B]
//! [--precision fp32|fp16|bf16] [--device NAME] [--steps N] [--seconds S] [--warmup W]
//! [--graph | --eager] [--workers N] [--svg PATH] [--trace PATH] [--folder DIR]`: ResNet training throughput end to
//! end — the loader on real JPEG shards, the input op, forward, backward and AdamW — with each
//! step split into its phases. `cargo xtask bench imagenet` drives it.
//!
//! Without `--device` it takes the registry's best device; a software adapter (only by name)
//! gets a small model at low resolution unless `--model`/`--res` say otherwise, and the output
//! names what ran. Measurement: `--warmup` steps, a device synchronisation, then steps until
//! `--steps` (or `--seconds` have passed and at least 5 steps ran).

use std::error::Error;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use redline::registry::{self, Kind};
use redline_loader::{Config, Loader, Position};
use redline_nn::{named_parameters, AdamW, ParamGroup, ResNet, ResNetConfig};
use redline_shard::ShardSet;
use redline_train::profile::{memory_json, stream_bandwidth, OpProfile, OpRow, StepProfile};
use redline_train::{chrome_trace, svg, Precision, Summary, TrainConfig, Trainer};
use serde_json::json;

/// ResNet training throughput end to end, each step split into its phases.
#[derive(Parser)]
#[command(name = "bench-imagenet")]
struct Cli {
    /// A shard set (the training images).
    #[arg(long)]
    shards: PathBuf,
    /// The JSON report.
    #[arg(long)]
    out: PathBuf,
    /// A device by name [default: the registry's best].
    #[arg(long)]
    device: Option<String>,
    /// resnet18, resnet34 or resnet50 [default: resnet50; resnet18 on a software device].
    #[arg(long)]
    model: Option<String>,
    /// Training resolution [default: 224; 32 on a software device].
    #[arg(long)]
    res: Option<usize>,
    /// Images per step [default: 8; 4 on a software device].
    #[arg(long)]
    batch: Option<usize>,
    /// Training precision [default: fp16 on a GPU, fp32 on the CPU or a software device].
    #[arg(long, value_parser = ["fp32", "fp16", "bf16"])]
    precision: Option<String>,
    /// Loader threads [default: every core].
    #[arg(long)]
    workers: Option<usize>,
    /// Steps before the measurement starts.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Measure exactly this many steps (else --seconds, and at least 5 steps).
    #[arg(long)]
    steps: Option<usize>,
    /// The measurement's budget when --steps is not given.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Account for every op and shape apart, timed on the device's clock where it has one
    /// (CUDA events, Vulkan timestamp queries), and print the table at the end. Without it the
    /// report still counts ops and host time by kind of op.
    #[arg(long)]
    profile_ops: bool,
    /// Replay the training step as a captured graph after the warm-up (a CUDA graph: one
    /// launch per step). The default on a CUDA GPU; elsewhere the device cannot capture, the
    /// steps run eagerly and the report's `graph` says why.
    #[arg(long, conflicts_with = "eager")]
    graph: bool,
    /// Run every step eagerly, also on a CUDA GPU (where the step is replayed as a graph by
    /// default).
    #[arg(long)]
    eager: bool,
    /// Also write the img/s and phase charts as SVG here.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Also write a Chrome trace of the first measured steps here.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Also write the records as an ImageFolder tree here (for the PyTorch side).
    #[arg(long)]
    folder: Option<PathBuf>,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-imagenet: {e}");
            ExitCode::FAILURE
        }
    }
}

type Res<T> = Result<T, Box<dyn Error>>;

fn run() -> Res<()> {
    let cli = Cli::parse();
    let (candidate, device) = registry::select(cli.device.as_deref())?;
    let software = candidate.software;
    // The doctor's yardstick for memory-bound ops, taken before anything else runs.
    // (64 MB: past every cache, and inside wgpu's 128 MB binding limit.)
    let stream_bytes = if software { 4 << 20 } else { 64 << 20 };
    let stream_gb_per_s = stream_bandwidth(&device, stream_bytes)?;
    // Every op counted by kind (and with --profile-ops, by op and shape, on the device's
    // clock) for the report's `ops` section.
    let (device, profile) = OpProfile::wrap(device, cli.profile_ops);
    // A software device (a software Vulkan adapter at ~0.3 GFLOP/s, the CUDA emulator slower
    // still) gets a small model at low resolution.
    let (default_model, default_res, default_batch) = if software {
        ("resnet18", 32, 4)
    } else {
        ("resnet50", 224, 8)
    };
    let model_name = cli.model.unwrap_or_else(|| default_model.into());
    let resnet = ResNetConfig::named(&model_name)?;
    let res = cli.res.unwrap_or(default_res);
    let batch = cli.batch.unwrap_or(default_batch);
    let precision: Precision = match cli.precision {
        Some(p) => p.parse()?,
        // AMP where the device has fast half precision; the CPU backend's is f32.
        None if candidate.kind == Kind::Cpu || software => Precision::Fp32,
        None => Precision::Fp16,
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = cli.workers.unwrap_or(cores);
    let (warmup, max_steps, seconds) = (cli.warmup, cli.steps, cli.seconds as f64);
    // A GPU step is one graph launch unless --eager: few large launches are half of what this
    // benchmark is about, and the report says where it ran eagerly and why.
    let graph = cli.graph || (!cli.eager && candidate.kind == Kind::Cuda && !software);
    // Under a graph the capture happens in the warm-up, not in the measured steps.
    let warmup = match graph {
        true => warmup.max(redline_train::GRAPH_WARMUP_STEPS + 1),
        false => warmup,
    };

    let set = Arc::new(
        ShardSet::open(&cli.shards).map_err(|e| format!("{}: {e}", cli.shards.display()))?,
    );
    if let Some(folder) = &cli.folder {
        redline_benches::export_folder(&set, folder)?;
    }
    let model = ResNet::new(resnet, &device)?;
    let macs = model.macs_per_image(res)?;
    let params = named_parameters(&model)
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    // The seed loop's optimizer: torch.optim.AdamW's defaults, one group.
    let adamw = AdamW::new(vec![ParamGroup::new(params, 0.01)], 0.9, 0.999, 1e-8)?;
    let config = TrainConfig {
        precision,
        label_smoothing: 0.0,
        clip_norm: None,
        base_lr: 1e-3,
        schedule: redline_nn::Schedule::Constant,
    };
    let num_params = redline_nn::num_parameters(&model);
    let mut trainer = Trainer::new(Box::new(model), Box::new(adamw), config, device.clone())?;
    if graph {
        trainer = trainer.with_graph();
    }
    // A step that fails under a graph says how to measure without one.
    let eager_hint = |e: redline_train::TrainError| -> Box<dyn Error> {
        match graph {
            true => format!("{e} (the step was replayed as a CUDA graph; --eager runs it eagerly)")
                .into(),
            false => e.into(),
        }
    };
    let loader_config = Config {
        workers,
        // Pinned batch buffers where the device has them (CUDA): uploads without staging.
        allocator: device.host_allocator(),
        ..Config::new(batch, res, true)
    };
    let mut loader = Loader::new(set.clone(), loader_config, Position::default())?;

    eprintln!(
        "bench-imagenet: {} ({} parameters) at {res}px, batch {batch}, {precision}, on {}; \
         JPEG decoder {}; {warmup} warm-up steps",
        model_name,
        num_params,
        device.name(),
        redline_loader::Codec::best().name()
    );
    for _ in 0..warmup {
        trainer
            .train_step(&mut loader)
            .map_err(eager_hint)?
            .loss
            .item()?;
    }
    device.synchronize()?;
    trainer.take_times()?;
    profile.reset();
    let memory_before = device.memory_stats();
    let started = Instant::now();
    // Nothing in the measured steps waits for the device: phase times arrive TIMES_LAG steps
    // late, and the loss shown is read asynchronously, one report late.
    let mut times = Vec::new();
    let mut last_loss = f64::NAN;
    let mut loss_read = false;
    let mut loss_in_flight = None;
    let mut steps = 0;
    loop {
        let step = trainer.train_step(&mut loader).map_err(eager_hint)?;
        steps += 1;
        times.extend(step.times);
        let done = match max_steps {
            Some(n) => steps >= n,
            None => started.elapsed().as_secs_f64() >= seconds && steps >= 5,
        };
        if steps % 5 == 0 || done {
            if let Some(loss) = loss_in_flight.replace(step.loss.to_vec_async::<f32>()?) {
                last_loss = loss.wait()?.first().map_or(f64::NAN, |&l| f64::from(l));
                loss_read = true;
            }
            let s = Summary::new(&times, batch);
            // Until the first asynchronous read lands there is no loss to show (not a NaN).
            let loss = match loss_read {
                true => format!("{last_loss:.3}"),
                false => "pending".into(),
            };
            eprint!(
                "\r  step {steps:>4}  {:>7.2} img/s  loss {loss}  {:.0} s ",
                s.images_per_sec,
                started.elapsed().as_secs_f64()
            );
        }
        if done {
            break;
        }
    }
    times.extend(trainer.take_times()?);
    if let Some(loss) = loss_in_flight {
        last_loss = loss.wait()?.first().map_or(f64::NAN, |&l| f64::from(l));
    }
    eprintln!();
    let rows = profile.rows();
    let device_timed = profile.device_timed();
    if cli.profile_ops {
        print_profile(&rows, times.len(), device_timed);
    }
    device.synchronize()?;
    // The caching allocator over the measured steps: nothing new from the device in a
    // steady state.
    let device_memory = memory_json(memory_before, device.memory_stats(), times.len());
    let synchronous = candidate.kind == Kind::Cpu;
    let ops = StepProfile::new(
        &rows,
        times.len(),
        synchronous,
        device_timed,
        cli.profile_ops,
    );
    let summary = Summary::new(&times, batch);
    let gmac = macs as f64 / 1e9;
    // Training ≈ 3× the forward pass (input and weight gradients), 2 FLOP per MAC.
    let gflops = 6.0 * gmac * summary.images_per_sec;
    let mut report = summary.to_json();
    let extra = json!({
        "device": device.name(),
        "device_kind": format!("{:?}", candidate.kind).to_lowercase(),
        "software_adapter": software,
        "model": model_name,
        "parameters": num_params,
        "resolution": res,
        "precision": precision.to_string(),
        "optimizer": "adamw",
        "workers": workers,
        "decoder": redline_loader::Codec::best().name(),
        "gmac_per_image": gmac,
        "achieved_gflops": gflops,
        "peak_memory_bytes": peak_rss(),
        "peak_memory_source": "process peak resident set (VmHWM)",
        "final_loss": last_loss,
        "loader_data_stall": loader.data_stall(),
        "measured_seconds": started.elapsed().as_secs_f64(),
        "stream_gb_per_s": stream_gb_per_s,
        "device_memory": device_memory,
        "ops": ops.to_json(),
        "graph": trainer.graph_stats().to_json(),
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        report[k] = v.clone();
    }
    std::fs::write(&cli.out, serde_json::to_string_pretty(&report)?)?;
    let title = format!(
        "{model_name} {res}px batch {batch} {precision} on {}: {:.2} img/s",
        device.name(),
        summary.images_per_sec
    );
    if let Some(path) = &cli.svg {
        std::fs::write(path, svg(&times, batch, &title))?;
    }
    if let Some(path) = &cli.trace {
        let few = &times[..times.len().min(10)];
        std::fs::write(path, serde_json::to_string(&chrome_trace(few))?)?;
    }
    Ok(())
}

/// The per-op table: ms per step for each op and shape, the largest first, and the total —
/// device time where the device's clock took it (the host's issue time beside it), else host
/// time.
fn print_profile(rows: &[OpRow], steps: usize, device_timed: bool) {
    let steps = steps.max(1) as f64;
    let per_step = |d: std::time::Duration| d.as_secs_f64() * 1e3 / steps;
    let time = |r: &OpRow| per_step(if device_timed { r.device } else { r.host });
    let total: f64 = rows.iter().map(time).sum();
    let clock = if device_timed {
        "device timestamps around each op; host: time spent issuing it"
    } else {
        "host timer around each op"
    };
    eprintln!("ops per step ({clock}), {total:.1} ms in all:");
    eprintln!(
        "  {:<44} {:>6} {:>9} {:>6} {:>9}",
        "op", "calls", "ms/step", "share", "host ms"
    );
    for r in rows {
        let ms = time(r);
        let calls = r.calls as f64 / steps;
        eprintln!(
            "  {:<44} {calls:>6.0} {ms:>9.2} {:>5.1}% {:>9.2}",
            r.label,
            100.0 * ms / total,
            per_step(r.host)
        );
    }
}

/// The process's peak resident memory in bytes (Linux), or None.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
