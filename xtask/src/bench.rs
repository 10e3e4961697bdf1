//! `cargo xtask bench …`: runs a benchmark, then prints (and optionally saves) its table.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use crate::run;

const INSTALL_TORCH: &str = "--vs pytorch needs PyTorch importable by `python3`: \
    `pip install torch` (the CPU is all it uses)";

#[derive(Subcommand)]
pub enum Bench {
    /// Shard reads: a full scan through the reader API next to memcpy of the same bytes, and
    /// random record access (criterion, `benches/benches/shards.rs`).
    Shards(BenchArgs),
    /// Op throughput in GFLOP/s — GEMM, 3×3 convolution (forward, forward+backward, NCHW and
    /// channels-last), batch norm — on a backend, optionally next to PyTorch in the same run.
    Ops(OpsArgs),
    /// The loader's training pipeline (img/s, per core, batch build p50/p99, decode rate),
    /// optionally next to PyTorch's DataLoader on the same images in the same run.
    Loader(LoaderArgs),
    /// ResNet training throughput end to end (loader → input op → forward → backward →
    /// AdamW) with the step breakdown; no arguments needed (`--vs pytorch` for the seed loop).
    Imagenet(crate::imagenet::ImagenetArgs),
    /// The CPU collective's all-reduce of a gradient bucket across local processes, optionally
    /// next to PyTorch's gloo backend (launched by torchrun) in the same run.
    Allreduce(AllreduceArgs),
}

#[derive(Args)]
pub struct AllreduceArgs {
    /// Processes (ranks) on this machine.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Megabytes of f32 per all-reduce (DDP's bucket: 25).
    #[arg(long, default_value_t = 25.0)]
    mb: f64,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Rounds, alternating the two sides; the report is the median round's.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Also time PyTorch's CPU all-reduce (gloo, `benches/pytorch/allreduce.py` under torchrun).
    #[arg(long, value_parser = ["gloo"])]
    vs: Option<String>,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Args)]
pub struct LoaderArgs {
    /// A shard set (`cargo xtask shards synth` or `shards build` makes one).
    #[arg(long)]
    shards: PathBuf,
    /// Decode threads (default: every core).
    #[arg(long)]
    workers: Option<usize>,
    #[arg(long, default_value_t = 64)]
    batch: usize,
    #[arg(long, default_value_t = 224)]
    res: usize,
    #[arg(long, default_value_t = 20)]
    seconds: usize,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run the same images through PyTorch's DataLoader (`benches/pytorch/loader.py`) or FFCV.
    #[arg(long, value_parser = ["pytorch", "ffcv"])]
    vs: Option<String>,
    /// The JPEG codec of the pipeline (default: libjpeg-turbo, cropped and DCT-scaled decodes).
    #[arg(long, value_parser = ["libjpeg-turbo", "zune-jpeg"])]
    codec: Option<String>,
}

#[derive(Args)]
pub struct OpsArgs {
    /// The backend: `cpu`, or `wgpu` (the first adapter; adapter-sized rows, with the CPU
    /// backend's same rows beside them).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "wgpu"])]
    device: String,
    /// Also write the results as JSON here: a list of {"name", "gflops", "pytorch_gflops"}.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run the same rows in PyTorch (benches/pytorch/ops.py) in the same invocation.
    #[arg(long, value_parser = ["pytorch"])]
    vs: Option<String>,
    /// Rounds (alternating redline and PyTorch); each side reports its best per row.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
}

#[derive(Args)]
pub struct BenchArgs {
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(bench: Bench) -> Result<()> {
    match bench {
        Bench::Shards(args) => shards(args),
        Bench::Ops(args) => ops(args),
        Bench::Loader(args) => loader(args),
        Bench::Imagenet(args) => crate::imagenet::run(args),
        Bench::Allreduce(args) => allreduce(args),
    }
}

/// Free TCP port on loopback for a job's rendezvous.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn allreduce(args: AllreduceArgs) -> Result<()> {
    if args.nproc < 2 || args.rounds == 0 {
        anyhow::bail!("--nproc must be at least 2 and --rounds at least 1");
    }
    if args.vs.is_some() && !python_has("torch.distributed.run") {
        anyhow::bail!("--vs gloo needs PyTorch importable by `python3`: `pip install torch`");
    }
    let mut build = run::cargo();
    build.args([
        "build",
        "--release",
        "--quiet",
        "--package",
        "redline-dist",
        "--example",
        "allreduce_bench",
    ]);
    run::check(&mut build)?;
    let binary = run::target_dir().join("release/examples/allreduce_bench");
    let sizes = [
        "--mb".to_string(),
        args.mb.to_string(),
        "--iters".to_string(),
        args.iters.to_string(),
    ];
    let threads = (std::thread::available_parallelism().map_or(1, |c| c.get()) / args.nproc)
        .max(1)
        .to_string();
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let path = run::target_dir().join(format!("bench-allreduce-{round}.json"));
        run::local_ranks(args.nproc, free_port()?, |_| {
            let mut cmd = std::process::Command::new(&binary);
            cmd.args(&sizes)
                .arg("--out")
                .arg(&path)
                .env("REDLINE_CPU_THREADS", &threads);
            cmd
        })?;
        ours.push(read_json(&path)?["median_ms"].as_f64().unwrap_or(f64::NAN));
        if args.vs.is_some() {
            let path = run::target_dir().join(format!("bench-allreduce-gloo-{round}.json"));
            let mut py = std::process::Command::new("python3");
            py.current_dir(run::root())
                .args([
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nnodes",
                    "1",
                ])
                .arg(format!("--nproc-per-node={}", args.nproc))
                .arg("benches/pytorch/allreduce.py")
                .args(&sizes)
                .arg("--out")
                .arg(&path)
                .env("OMP_NUM_THREADS", &threads);
            run::check(&mut py)?;
            theirs.push(read_json(&path)?["median_ms"].as_f64().unwrap_or(f64::NAN));
        }
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let gb = args.mb * 1e6 / 1e9;
    let (ms, gloo_ms) = (median(&ours), median(&theirs));
    println!(
        "\nbench allreduce: {} processes, {} MB f32 averaged, median of {} iterations, {} rounds",
        args.nproc, args.mb, args.iters, args.rounds
    );
    println!(
        "  redline (TCP star)  {ms:>9.2} ms  {:>6.2} GB/s",
        gb / (ms / 1e3)
    );
    let mut report = json!({
        "nproc": args.nproc, "mb": args.mb, "iters": args.iters, "rounds": ours,
        "median_ms": ms, "algbw_gb_per_s": gb / (ms / 1e3),
    });
    if args.vs.is_some() {
        println!(
            "  PyTorch gloo        {gloo_ms:>9.2} ms  {:>6.2} GB/s   redline ÷ gloo time: {:.2}×",
            gb / (gloo_ms / 1e3),
            ms / gloo_ms
        );
        report["gloo_rounds"] = json!(theirs);
        report["gloo_median_ms"] = json!(gloo_ms);
        report["time_ratio_vs_gloo"] = json!(ms / gloo_ms);
    }
    if let Some(path) = &args.json {
        fs::write(path, serde_json::to_string_pretty(&report)? + "\n")?;
    }
    Ok(())
}

/// One criterion result: median time per iteration and what one iteration processes.
struct Measured {
    name: &'static str,
    median_ns: f64,
    throughput: Throughput,
}

enum Throughput {
    Bytes(f64),
    Elements(f64),
}

fn shards(args: BenchArgs) -> Result<()> {
    run::check(run::cargo().args(["bench", "--package", "redline-benches", "--bench", "shards"]))?;
    let dir = run::target_dir().join("criterion/shards");
    let names = [
        "scan",
        "scan_verified",
        "memcpy",
        "random_unverified",
        "random_verified",
    ];
    let results = names
        .iter()
        .map(|name| read_criterion(&dir, name))
        .collect::<Result<Vec<_>>>()?;
    let memcpy_gbps = results
        .iter()
        .find(|m| m.name == "memcpy")
        .and_then(|m| rate(m).filter(|_| matches!(m.throughput, Throughput::Bytes(_))))
        .unwrap_or(f64::NAN);

    println!(
        "\n{:<20} {:>12} {:>18} {:>12}",
        "benchmark", "median", "rate", "vs memcpy"
    );
    let mut rows = Vec::new();
    for m in &results {
        let r = rate(m).unwrap_or(f64::NAN);
        let (rate_text, vs, unit) = match m.throughput {
            Throughput::Bytes(_) => (
                format!("{:.2} GB/s", r),
                format!("{:.2}x", r / memcpy_gbps),
                "gb_per_s",
            ),
            Throughput::Elements(_) => (format!("{:.0} rec/s", r), "-".into(), "records_per_s"),
        };
        println!(
            "{:<20} {:>12} {:>18} {:>12}",
            m.name,
            format!("{:.3} ms", m.median_ns / 1e6),
            rate_text,
            vs
        );
        let mut row = json!({"name": m.name, "median_ns": m.median_ns});
        row[unit] = json!(r);
        if unit == "gb_per_s" {
            row["vs_memcpy"] = json!(r / memcpy_gbps);
        }
        rows.push(row);
    }
    if let Some(path) = args.json {
        let scan = results.iter().find(|m| m.name == "scan").and_then(rate);
        let report = json!({
            "benchmark": "shards",
            "scan_vs_memcpy": scan.map(|s| s / memcpy_gbps),
            "results": rows,
        });
        fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// GB/s for byte throughput, items/s for element throughput.
fn rate(m: &Measured) -> Option<f64> {
    let per_second = 1e9 / m.median_ns;
    Some(match m.throughput {
        Throughput::Bytes(b) => b * per_second / 1e9,
        Throughput::Elements(n) => n * per_second,
    })
}

fn read_criterion(dir: &Path, name: &'static str) -> Result<Measured> {
    let read = |file: &str| -> Result<Value> {
        let path = dir.join(name).join("new").join(file);
        let text = fs::read_to_string(&path)
            .with_context(|| format!("criterion wrote no {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
    };
    let estimates = read("estimates.json")?;
    let benchmark = read("benchmark.json")?;
    let median_ns = estimates["median"]["point_estimate"]
        .as_f64()
        .with_context(|| format!("{name}: no median in estimates.json"))?;
    let t = &benchmark["throughput"];
    let throughput = if let Some(b) = t["Bytes"].as_f64() {
        Throughput::Bytes(b)
    } else if let Some(n) = t["Elements"].as_f64() {
        Throughput::Elements(n)
    } else {
        anyhow::bail!("{name}: no throughput in benchmark.json ({t})")
    };
    Ok(Measured {
        name,
        median_ns,
        throughput,
    })
}

fn read_json(path: &Path) -> Result<Value> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

fn ops(args: OpsArgs) -> Result<()> {
    let vs_pytorch = args.vs.is_some();
    if vs_pytorch {
        let ok = std::process::Command::new("python3")
            .args(["-c", "import torch"])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            anyhow::bail!("{INSTALL_TORCH}");
        }
    }
    let ours_path = run::target_dir().join("bench-ops.json");
    let features: &[&str] = if args.device == "wgpu" {
        &["wgpu"]
    } else {
        &[]
    };
    let mut cmd = run::bench_binary("bench-ops", features);
    cmd.args(["--device", &args.device])
        .arg("--out")
        .arg(&ours_path);
    // Rounds alternate redline and PyTorch, and each side keeps its best figure per row: on a
    // shared machine whose speed drifts, neither side gets only the slow minutes.
    let rounds = args.rounds.max(1);
    let mut ours = Value::Null;
    let mut rows: Vec<Value> = Vec::new();
    let mut theirs: Vec<(String, f64)> = Vec::new();
    for round in 1..=rounds {
        if rounds > 1 {
            eprintln!("round {round} of {rounds}");
        }
        run::check(&mut cmd)?;
        ours = read_json(&ours_path)?;
        for r in ours["rows"].as_array().cloned().unwrap_or_default() {
            match rows.iter_mut().find(|old| old["name"] == r["name"]) {
                Some(old) if old["gflops"].as_f64() >= r["gflops"].as_f64() => {}
                Some(old) => *old = r,
                None => rows.push(r),
            }
        }
        if vs_pytorch {
            let names: Vec<String> = rows
                .iter()
                .filter_map(|r| r["name"].as_str().map(String::from))
                .collect();
            let path = run::target_dir().join("bench-ops-pytorch.json");
            eprintln!("PyTorch, same rows:");
            let mut py = std::process::Command::new("python3");
            py.current_dir(run::root())
                .arg("benches/pytorch/ops.py")
                .args(["--rows", &names.join(",")])
                .arg("--out")
                .arg(&path);
            run::check(&mut py)?;
            let report = read_json(&path)?;
            for r in report["rows"].as_array().cloned().unwrap_or_default() {
                if let (Some(n), Some(g)) = (r["name"].as_str(), r["gflops"].as_f64()) {
                    match theirs.iter_mut().find(|(old, _)| old == n) {
                        Some((_, best)) => *best = best.max(g),
                        None => theirs.push((n.to_string(), g)),
                    }
                }
            }
        }
    }
    let pytorch = |name: &str| theirs.iter().find(|(n, _)| n == name).map(|(_, g)| *g);

    let device = ours["device"].as_str().unwrap_or("?");
    let wgpu = args.device == "wgpu";
    println!(
        "\nbench ops on {device} (GFLOP/s = counted FLOPs / median time, best of {rounds} \
         round(s); higher is better)"
    );
    print!("{:<32} {:>12}", "row", "redline");
    if wgpu {
        print!(" {:>12}", "redline cpu");
    }
    if vs_pytorch {
        print!(" {:>12} {:>8}", "pytorch", "ratio");
    }
    println!();
    let mut out = Vec::new();
    for r in &rows {
        let name = r["name"].as_str().unwrap_or("?");
        let g = r["gflops"].as_f64().unwrap_or(f64::NAN);
        print!("{name:<32} {g:>12.1}");
        let mut row = json!({"name": name, "gflops": g, "pytorch_gflops": pytorch(name)});
        if let Some(c) = r["cpu_gflops"].as_f64() {
            print!(" {c:>12.1}");
            row["cpu_gflops"] = json!(c);
        }
        if let Some(p) = pytorch(name) {
            print!(" {p:>12.1} {:>7.2}x", g / p);
        }
        println!();
        out.push(row);
    }
    if vs_pytorch && !wgpu {
        summary(&rows, &pytorch);
    }
    if let Some(path) = args.json {
        fs::write(
            &path,
            serde_json::to_string_pretty(&Value::Array(out))? + "\n",
        )
        .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// The goals: GEMM 1024, and conv forward+backward with each side at its best layout.
fn summary(rows: &[Value], pytorch: &dyn Fn(&str) -> Option<f64>) {
    let ours = |name: &str| {
        rows.iter()
            .find(|r| r["name"] == name)
            .and_then(|r| r["gflops"].as_f64())
    };
    let best = |f: &dyn Fn(&str) -> Option<f64>, stem: &str| {
        ["nchw", "nhwc"]
            .iter()
            .filter_map(|l| f(&format!("{stem}_{l}")).map(|g| (g, *l)))
            .max_by(|a, b| a.0.total_cmp(&b.0))
    };
    if let (Some(a), Some(b)) = (ours("gemm_1024"), pytorch("gemm_1024")) {
        println!("gemm_1024: {:.2}x PyTorch (goal >= 0.9x)", a / b);
    }
    let stem = "conv3x3_64_56_b8_fwdbwd";
    if let (Some((a, la)), Some((b, lb))) = (best(&ours, stem), best(pytorch, stem)) {
        println!("conv fwd+bwd, best layouts (redline {la}, PyTorch {lb}): {:.2}x PyTorch (goal >= 1.0x)", a / b);
    }
}

pub fn python_has(modules: &str) -> bool {
    std::process::Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn loader(args: LoaderArgs) -> Result<()> {
    match args.vs.as_deref() {
        Some("pytorch") if !python_has("torch, torchvision") => anyhow::bail!(
            "--vs pytorch needs torch and torchvision importable by `python3`: \
             `pip install torch torchvision`"
        ),
        Some("ffcv") if !python_has("ffcv, torchvision") => anyhow::bail!(
            "--vs ffcv needs FFCV and torchvision importable by `python3`: \
             `apt-get install libturbojpeg0-dev libopencv-dev pkg-config`, then \
             `pip install ffcv torchvision`"
        ),
        _ => {}
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = args.workers.unwrap_or(cores);
    let ours_path = run::target_dir().join("bench-loader.json");
    let folder = run::target_dir().join("bench-loader-imagefolder");
    // The flags both sides take, so they run the same workload.
    let shared: Vec<String> = [
        ("--workers", workers),
        ("--batch", args.batch),
        ("--res", args.res),
        ("--seconds", args.seconds),
    ]
    .iter()
    .flat_map(|(flag, value)| [flag.to_string(), value.to_string()])
    .collect();
    let decoder: Vec<&str> = run::fast_decoder().into_iter().collect();
    let mut cmd = run::bench_binary("bench-loader", &decoder);
    cmd.arg("--shards")
        .arg(&args.shards)
        .arg("--out")
        .arg(&ours_path)
        .args(&shared);
    if let Some(codec) = &args.codec {
        cmd.arg("--codec").arg(codec);
    }
    if args.vs.is_some() {
        let _ = fs::remove_dir_all(&folder);
        cmd.arg("--folder").arg(&folder);
    }
    run::check(&mut cmd)?;
    let mut report = read_json(&ours_path)?;
    let ours = report["images_per_sec"].as_f64().unwrap_or(f64::NAN);
    if let Some(vs) = args.vs.as_deref() {
        let (script, key) = match vs {
            "ffcv" => ("benches/pytorch/ffcv_loader.py", "ffcv_images_per_sec"),
            _ => ("benches/pytorch/loader.py", "pytorch_images_per_sec"),
        };
        let path = run::target_dir().join(format!("bench-loader-{vs}.json"));
        let mut py = std::process::Command::new("python3");
        py.current_dir(run::root())
            .arg(script)
            .arg("--folder")
            .arg(&folder)
            .arg("--out")
            .arg(&path)
            .args(&shared);
        run::check(&mut py)?;
        let theirs = read_json(&path)?["images_per_sec"].as_f64();
        report[key] = json!(theirs);
    }
    let f = |k: &str| report[k].as_f64().unwrap_or(f64::NAN);
    println!(
        "\nbench loader: {} workers, batch {}, {}px, {} s",
        workers, args.batch, args.res, args.seconds
    );
    println!(
        "  redline        {:>8.0} img/s  ({:.0} per core)",
        ours,
        f("images_per_sec_per_core")
    );
    println!(
        "  batch build    p50 {:.1} ms, p99 {:.1} ms",
        f("batch_build_p50_ms"),
        f("batch_build_p99_ms")
    );
    println!(
        "  codec          {} (cropped + DCT-scaled decodes where the codec has them)",
        report["decoder"].as_str().unwrap_or("?")
    );
    if let Some(rates) = report["full_decode_images_per_sec_one_core"].as_object() {
        for (name, rate) in rates {
            println!(
                "  full decode    {:>8.0} img/s on one core ({name}, whole image, same records)",
                rate.as_f64().unwrap_or(f64::NAN)
            );
        }
    }
    if let Some(p) = report["pytorch_images_per_sec"].as_f64() {
        println!(
            "  PyTorch        {:>8.0} img/s  → redline {:.2}x",
            p,
            ours / p
        );
    }
    if let Some(p) = report["ffcv_images_per_sec"].as_f64() {
        println!(
            "  FFCV           {:>8.0} img/s  → redline {:.2}x (goal ≥ 1.2x)",
            p,
            ours / p
        );
    }
    if let Some(path) = args.json {
        fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
