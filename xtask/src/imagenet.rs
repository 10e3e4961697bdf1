//! `cargo xtask bench imagenet`: ResNet training throughput end to end, on the synthetic set
//! unless `--data` names another, optionally next to PyTorch's loop in the same invocation.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;

use crate::run::{self, Profile};

const INSTALL_TORCH: &str = "--vs pytorch needs torch and torchvision importable by `python3`: \
    `pip install torch torchvision` (the CPU is all it uses)";

/// The synthetic set the bench makes once: ImageNet-like JPEGs (~500×375, ~100 KB).
const SYNTH_IMAGES: u64 = 1000;
const SYNTH_CLASSES: u64 = 10;

const GIB: f64 = (1u64 << 30) as f64;

#[derive(Args)]
pub struct ImagenetArgs {
    /// Shards (a set, or a folder with `train/`) or an ImageFolder tree (converted once, cached).
    /// Default: the synthetic set, generated once under target/.
    #[arg(long)]
    data: Option<PathBuf>,
    /// resnet18, resnet34 or resnet50 (default: resnet50; resnet18 on a software adapter).
    #[arg(long)]
    model: Option<String>,
    /// Training resolution (default 224; 32 on a software adapter).
    #[arg(long)]
    res: Option<usize>,
    /// Batch size (default 8; 4 on a software adapter).
    #[arg(long)]
    batch: Option<usize>,
    /// fp32, fp16 or bf16 (default: fp16 on a GPU, fp32 on the CPU).
    #[arg(long, value_parser = ["fp32", "fp16", "bf16"])]
    precision: Option<String>,
    /// cpu, wgpu, `wgpu:<adapter>` (default: the registry's best device).
    #[arg(long)]
    device: Option<String>,
    /// Measured steps (default: as many as fit in --seconds, at least 5).
    #[arg(long)]
    steps: Option<usize>,
    /// Measurement budget in seconds when --steps is not given.
    #[arg(long, default_value_t = 60)]
    seconds: usize,
    /// Warm-up steps before measuring.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Loader threads (default: every core).
    #[arg(long)]
    workers: Option<usize>,
    /// Where the JSON report goes (default target/bench-imagenet.json; an SVG and a Chrome trace
    /// are written beside it).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run the seed's PyTorch loop (benches/pytorch/imagenet.py) on the same data, model,
    /// batch, precision and resolution, at its best memory layout.
    #[arg(long, value_parser = ["pytorch"])]
    vs: Option<String>,
    /// With --vs: alternate the two sides this many times, each round measuring both for
    /// --seconds / rounds, and compare medians — a shared machine's speed drifts over minutes,
    /// and one long run per side puts that drift into the ratio.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Also print a table of the time each op and shape takes per step (host timers around
    /// each op: exact on the CPU backend, only the enqueue on an asynchronous device).
    #[arg(long)]
    profile_ops: bool,
    /// Replay the training step as a captured graph after the warm-up: the default on a CUDA
    /// GPU; elsewhere the device cannot capture, the steps run eagerly and the report says why.
    #[arg(long, conflicts_with = "eager")]
    graph: bool,
    /// Run every step eagerly, also on a CUDA GPU.
    #[arg(long)]
    eager: bool,
}

pub fn run(args: ImagenetArgs) -> Result<()> {
    if args.vs.is_some() && !crate::bench::python_has("torch, torchvision") {
        bail!(INSTALL_TORCH);
    }
    let work = run::target_dir().join("bench-imagenet");
    let shards = match &args.data {
        None => synthetic(&work)?,
        Some(path) => shard_set(path, &work)?,
    };
    let json_path = args
        .json
        .clone()
        .unwrap_or_else(|| run::target_dir().join("bench-imagenet.json"));
    let svg_path = json_path.with_extension("svg");
    let trace_path = json_path.with_extension("trace.json");
    let folder = work.join("imagefolder");

    let rounds = if args.vs.is_some() {
        args.rounds.max(1)
    } else {
        1
    };
    let seconds = args.seconds.div_ceil(rounds).max(1);
    let options = [
        ("--model", args.model.clone()),
        ("--res", args.res.map(|v| v.to_string())),
        ("--batch", args.batch.map(|v| v.to_string())),
        ("--precision", args.precision.clone()),
        ("--device", args.device.clone()),
        ("--steps", args.steps.map(|v| v.to_string())),
        ("--workers", args.workers.map(|v| v.to_string())),
        ("--seconds", Some(seconds.to_string())),
        ("--warmup", Some(args.warmup.to_string())),
    ];
    // The bench's command, built afresh for each round (a Command cannot be cloned).
    let decoder: Vec<&str> = run::fast_decoder().into_iter().collect();
    let bench = || {
        let mut cmd = run::bench_binary("bench-imagenet", &decoder);
        cmd.arg("--shards")
            .arg(&shards)
            .arg("--out")
            .arg(&json_path);
        for (flag, value) in &options {
            if let Some(v) = value {
                cmd.arg(flag).arg(v);
            }
        }
        if args.profile_ops {
            cmd.arg("--profile-ops");
        }
        if args.graph {
            cmd.arg("--graph");
        }
        if args.eager {
            cmd.arg("--eager");
        }
        cmd
    };
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for round in 0..rounds {
        if rounds > 1 {
            eprintln!("round {} of {rounds}", round + 1);
        }
        let mut cmd = bench();
        // Each round's SVG and trace apart; the median round's become the report's.
        cmd.arg("--svg")
            .arg(round_file(&svg_path, round, rounds))
            .arg("--trace")
            .arg(round_file(&trace_path, round, rounds));
        if args.vs.is_some() && round == 0 {
            // The bench writes the ImageFolder copy PyTorch's loader reads.
            let _ = fs::remove_dir_all(&folder);
            cmd.arg("--folder").arg(&folder);
        }
        run::check(&mut cmd)?;
        let report = read(&json_path)?;
        if args.vs.is_some() {
            theirs.push(pytorch(&args, &report, &folder, &work, seconds)?);
        }
        ours.push(report);
    }
    let report = if args.vs.is_some() {
        let (report, middle) = compare(ours, theirs);
        fs::write(&json_path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", json_path.display()))?;
        for path in [&svg_path, &trace_path] {
            if rounds > 1 {
                fs::rename(round_file(path, middle, rounds), path)
                    .with_context(|| format!("writing {}", path.display()))?;
                for round in (0..rounds).filter(|&r| r != middle) {
                    let _ = fs::remove_file(round_file(path, round, rounds));
                }
            }
        }
        report
    } else {
        ours.remove(0)
    };
    print_table(&report);
    println!(
        "wrote {}, {} and {}",
        json_path.display(),
        svg_path.display(),
        trace_path.display()
    );
    Ok(())
}

/// Where round `round` of `rounds` writes `path` (itself when there is one round).
fn round_file(path: &Path, round: usize, rounds: usize) -> PathBuf {
    if rounds == 1 {
        return path.to_path_buf();
    }
    let name = path
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy());
    path.with_file_name(format!("round{}.{name}", round + 1))
}

/// One run of the seed's PyTorch loop on what `ours` measured (model, resolution, batch,
/// precision, loader threads), both layouts; its JSON.
fn pytorch(
    args: &ImagenetArgs,
    ours: &Value,
    folder: &Path,
    work: &Path,
    seconds: usize,
) -> Result<Value> {
    let theirs_path = work.join("pytorch.json");
    let text = |k: &str| ours[k].to_string().trim_matches('"').to_string();
    let mut py = std::process::Command::new("python3");
    py.current_dir(run::root())
        .arg("benches/pytorch/imagenet.py")
        .arg("--folder")
        .arg(folder)
        .arg("--out")
        .arg(&theirs_path)
        .args(["--model", &text("model")])
        .args(["--res", &text("resolution")])
        .args(["--batch", &text("batch")])
        .args(["--precision", &text("precision")])
        .args(["--workers", &text("workers")])
        .args(["--warmup", &args.warmup.to_string()])
        .args(["--seconds", &seconds.to_string()]);
    if let Some(n) = args.steps {
        py.args(["--steps", &n.to_string()]);
    }
    run::check(&mut py)?;
    read(&theirs_path)
}

/// The report of the median round (by our img/s: its breakdown, SVG and trace belong to it),
/// with PyTorch's median best-layout img/s and every round's pair and ratio; and that round.
fn compare(ours: Vec<Value>, theirs: Vec<Value>) -> (Value, usize) {
    let ips = |v: &Value| v["images_per_sec"].as_f64().unwrap_or(f64::NAN);
    let mut order: Vec<usize> = (0..ours.len()).collect();
    order.sort_by(|&a, &b| ips(&ours[a]).total_cmp(&ips(&ours[b])));
    let middle = order[(order.len() - 1) / 2];
    let mut report = ours[middle].clone();
    let mut by_theirs: Vec<usize> = (0..theirs.len()).collect();
    by_theirs.sort_by(|&a, &b| ips(&theirs[a]).total_cmp(&ips(&theirs[b])));
    let their_middle = &theirs[by_theirs[(by_theirs.len() - 1) / 2]];
    let rounds: Vec<Value> = ours
        .iter()
        .zip(&theirs)
        .map(|(o, t)| {
            serde_json::json!({
                "images_per_sec": ips(o),
                "pytorch_images_per_sec": ips(t),
                "pytorch_layout": t["layout"],
                "ratio": ips(o) / ips(t),
            })
        })
        .collect();
    let mut ratios: Vec<f64> = rounds
        .iter()
        .map(|r| r["ratio"].as_f64().unwrap_or(f64::NAN))
        .collect();
    ratios.sort_by(f64::total_cmp);
    report["pytorch_images_per_sec"] = Value::from(ips(their_middle));
    report["pytorch_layout"] = their_middle["layout"].clone();
    report["pytorch_runs"] = their_middle["runs"].clone();
    report["vs_pytorch_rounds"] = Value::from(rounds);
    report["ratio_median"] = Value::from(ratios[(ratios.len() - 1) / 2]);
    (report, middle)
}

fn read(path: &Path) -> Result<Value> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The synthetic training set, generated on first use.
fn synthetic(work: &Path) -> Result<PathBuf> {
    let dir = work.join(format!("synth-{SYNTH_CLASSES}x{SYNTH_IMAGES}"));
    let train = dir.join("train");
    if !train.join("manifest.json").exists() {
        eprintln!(
            "generating the synthetic set once (cached in {})",
            dir.display()
        );
        let _ = fs::remove_dir_all(&dir);
        let mut synth = run::data_tool_command(Profile::Release);
        synth.args(["synth", "--out"]).arg(&dir).args([
            "--classes",
            &SYNTH_CLASSES.to_string(),
            "--images",
            &SYNTH_IMAGES.to_string(),
        ]);
        run::check(&mut synth)?;
    }
    Ok(train)
}

/// `path` as a training shard set: itself, or the `train/` of what [`crate::data::shards`]
/// makes of it.
fn shard_set(path: &Path, work: &Path) -> Result<PathBuf> {
    let shards = crate::data::shards(path, work)?;
    Ok(if shards.join("manifest.json").exists() {
        shards
    } else {
        shards.join("train")
    })
}

fn print_table(r: &Value) {
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    let s = |k: &str| r[k].as_str().unwrap_or("?").to_string();
    println!(
        "\nbench imagenet: {} on {}{}",
        s("model"),
        s("device"),
        if r["software_adapter"].as_bool() == Some(true) {
            " (a software adapter: small model, low resolution)"
        } else {
            ""
        }
    );
    println!(
        "  resolution {}px, batch {}, {}, AdamW, {} measured steps, JPEG decoder {}",
        r["resolution"],
        r["batch"],
        s("precision"),
        r["steps"],
        s("decoder")
    );
    println!("  throughput     {:>8.2} img/s", f("images_per_sec"));
    println!(
        "  step           p50 {:.0} ms, p90 {:.0} ms",
        f("step_p50_ms"),
        f("step_p90_ms")
    );
    let b = &r["breakdown_p50_ms"];
    println!("  breakdown (p50, {})", s("phase_clock"));
    let total: f64 = [
        "data_wait",
        "host_to_device",
        "forward",
        "backward",
        "optimizer",
    ]
    .iter()
    .map(|k| b[k].as_f64().unwrap_or(0.0))
    .sum();
    for k in [
        "data_wait",
        "host_to_device",
        "forward",
        "backward",
        "optimizer",
    ] {
        let v = b[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "    {k:<15} {v:>8.1} ms  {:>5.1}%",
            100.0 * v / total.max(1e-9)
        );
    }
    println!("  data stall     {:.3} of the step time", f("data_stall"));
    let m = &r["device_memory"];
    if let Some(reserved) = m["reserved_bytes"].as_f64() {
        println!(
            "  device memory  {:.2} GiB reserved, peak {:.2} GiB in use, {} device allocations \
             while measuring",
            reserved / GIB,
            m["peak_in_use_bytes"].as_f64().unwrap_or(f64::NAN) / GIB,
            m["device_allocations_measured"]
        );
    }
    if let Some(peak) = r["peak_memory_bytes"].as_f64() {
        println!("  peak memory    {:.2} GiB (process peak RSS)", peak / GIB);
    }
    println!(
        "  compute        {:.2} GMAC/img, {:.1} GFLOP/s achieved (training = 3 × forward)",
        f("gmac_per_image"),
        f("achieved_gflops")
    );
    if let Some(p) = r["pytorch_images_per_sec"].as_f64() {
        println!(
            "  PyTorch        {:>8.2} img/s ({}, its best layout) → redline {:.2}x",
            p,
            r["pytorch_layout"].as_str().unwrap_or("?"),
            f("images_per_sec") / p
        );
        for run in r["pytorch_runs"].as_array().into_iter().flatten() {
            println!(
                "    {:<14} {:>8.2} img/s",
                run["layout"].as_str().unwrap_or("?"),
                run["images_per_sec"].as_f64().unwrap_or(f64::NAN)
            );
        }
        let rounds = r["vs_pytorch_rounds"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if rounds.len() > 1 {
            println!(
                "  rounds (alternating; medians above)  median ratio {:.2}x",
                f("ratio_median")
            );
            for (i, round) in rounds.iter().enumerate() {
                let g = |k: &str| round[k].as_f64().unwrap_or(f64::NAN);
                println!(
                    "    {:<2} redline {:>6.2}  PyTorch {:>6.2} ({})  {:.2}x",
                    i + 1,
                    g("images_per_sec"),
                    g("pytorch_images_per_sec"),
                    round["pytorch_layout"].as_str().unwrap_or("?"),
                    g("ratio")
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_paths_resolve_to_training_shard_sets() {
        let dir = std::env::temp_dir().join(format!("xtask-imagenet-{}", std::process::id()));
        let set = dir.join("set");
        fs::create_dir_all(set.join("train")).unwrap();
        fs::write(set.join("train/manifest.json"), "{}").unwrap();
        assert_eq!(shard_set(&set, &dir).unwrap(), set.join("train"));
        assert_eq!(
            shard_set(&set.join("train"), &dir).unwrap(),
            set.join("train")
        );
        let err = shard_set(&dir.join("missing"), &dir).unwrap_err();
        assert!(err.to_string().contains("not a directory"), "{err}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
