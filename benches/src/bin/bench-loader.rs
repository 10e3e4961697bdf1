//! `bench-loader --shards DIR --out PATH [--workers N] [--batch B] [--res R] [--seconds S]
//! [--codec NAME] [--folder DIR]`: the loader's training pipeline for S seconds after a warm-up
//! batch — img/s, img/s per core, p50/p99 batch build time — with the chosen JPEG codec
//! (default: the fastest built in), and every built-in codec's plain full-image decode rate on
//! one core, on the same images. `--folder DIR` also writes the records as an ImageFolder tree
//! (for the PyTorch side). `cargo xtask bench loader` drives it.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use redline_loader::{Codec, Config, Decoder, Loader, Position};
use redline_shard::ShardSet;
use serde_json::json;

/// The loader's training pipeline, and each JPEG codec's decode rate, on the same shards.
#[derive(Parser)]
#[command(name = "bench-loader")]
struct Cli {
    /// A shard set.
    #[arg(long)]
    shards: PathBuf,
    /// The JSON report.
    #[arg(long)]
    out: PathBuf,
    /// Loader threads [default: every core].
    #[arg(long)]
    workers: Option<usize>,
    #[arg(long, default_value_t = 64)]
    batch: usize,
    #[arg(long, default_value_t = 224)]
    res: usize,
    /// How long the pipeline runs after its warm-up batch.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    /// The JPEG codec by name [default: the fastest built in].
    #[arg(long)]
    codec: Option<String>,
    /// Also write the records as an ImageFolder tree here (for the PyTorch side).
    #[arg(long)]
    folder: Option<PathBuf>,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-loader: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (workers, batch, res) = (cli.workers.unwrap_or(cores), cli.batch, cli.res);
    let seconds = cli.seconds as f64;
    let set = Arc::new(
        ShardSet::open(&cli.shards).map_err(|e| format!("{}: {e}", cli.shards.display()))?,
    );
    if let Some(folder) = &cli.folder {
        redline_benches::export_folder(&set, folder)?;
    }

    let codec = match cli.codec {
        None => Codec::best(),
        Some(name) => *Codec::available()
            .iter()
            .find(|c| c.name() == name)
            .ok_or_else(|| {
                let known: Vec<_> = Codec::available().iter().map(|c| c.name()).collect();
                format!("--codec {name}: this build has {}", known.join(", "))
            })?,
    };

    // Each codec alone, one core: full-image decodes per second of the same records.
    let mut decode_rates = serde_json::Map::new();
    for &c in Codec::available() {
        let mut decoder = Decoder::with_codec(c);
        let (start, mut decoded) = (Instant::now(), 0u64);
        while start.elapsed().as_secs_f64() < (seconds / 8.0).max(1.0) {
            let record = set.record(decoded % set.len())?;
            decoder.decode(record.bytes)?;
            decoded += 1;
        }
        decode_rates.insert(
            c.name().into(),
            json!(decoded as f64 / start.elapsed().as_secs_f64()),
        );
    }

    let mut config = Config::new(batch, res, true);
    config.workers = workers;
    config.codec = codec;
    let mut loader = Loader::new(set.clone(), config, Position::default())?;
    loader.next().ok_or("no batch")??;
    let (start, mut images, mut build) = (Instant::now(), 0usize, Vec::new());
    while start.elapsed().as_secs_f64() < seconds {
        let b = loader.next().ok_or("the loader ended")??;
        images += b.len;
        build.push(b.stats.work);
    }
    let elapsed = start.elapsed().as_secs_f64();
    build.sort();
    let pct = |p: f64| {
        build
            .get(((build.len() - 1) as f64 * p) as usize)
            .copied()
            .unwrap_or(Duration::ZERO)
    };
    let rate = images as f64 / elapsed;
    let report = json!({
        "images_per_sec": rate,
        "images_per_sec_per_core": rate / workers.min(cores) as f64,
        "workers": workers,
        "batch": batch,
        "res": res,
        "images": images,
        "seconds": elapsed,
        "batch_build_p50_ms": pct(0.5).as_secs_f64() * 1e3,
        "batch_build_p99_ms": pct(0.99).as_secs_f64() * 1e3,
        "decode_images_per_sec_one_core": decode_rates[codec.name()],
        "full_decode_images_per_sec_one_core": decode_rates,
        "data_stall": loader.data_stall(),
        "decoder": codec.name(),
    });
    std::fs::write(&cli.out, serde_json::to_string_pretty(&report)? + "\n")?;
    Ok(())
}
