//! `redline-data`: make, convert, verify and inspect shard sets (`cargo xtask shards …`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use redline_datasets::convert::{convert_folder, ConvertOptions};
use redline_datasets::generate::{synth_folder, synth_shards, SynthOptions};
use redline_datasets::DataError;
use redline_shard::{ShardSet, MANIFEST_FILE};

#[derive(Parser)]
#[command(
    name = "redline-data",
    about = "Make, convert, verify and inspect redline shard sets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert an ImageFolder tree (`DIR/<class>/<image>`, or `DIR/train` + `DIR/val`) to shard sets.
    /// Run again after a kill, it resumes (journal `build.json` in each set); a folder holding
    /// another build is left alone and the exit code is 3.
    Build {
        /// The ImageFolder tree.
        #[arg(long)]
        from_folder: PathBuf,
        /// Where the shard set(s) go.
        #[arg(long)]
        out: PathBuf,
        /// Resize so the longer side is at most N pixels and re-encode as JPEG (FFCV uses 256–512).
        #[arg(long)]
        max_side: Option<u32>,
        /// JPEG quality when re-encoding.
        #[arg(long, default_value_t = 90)]
        quality: u8,
        /// Target bytes per shard file.
        #[arg(long, default_value_t = 256 << 20)]
        shard_size: u64,
        /// Stop at the first unreadable file instead of skipping it.
        #[arg(long)]
        strict: bool,
        /// Worker threads (default: every core).
        #[arg(long)]
        threads: Option<usize>,
        /// Labels of a flat `val/` folder: Kaggle's LOC_val_solution.csv (found next to the data
        /// when not given) or the devkit's ILSVRC2012_validation_ground_truth.txt.
        #[arg(long)]
        val_labels: Option<PathBuf>,
        /// With the devkit's ground truth: the synsets in the devkit's ID order (meta.mat's),
        /// one wnid per line.
        #[arg(long)]
        val_synsets: Option<PathBuf>,
    },
    /// Generate the synthetic ImageNet-like set (train/ + val/), deterministic in the seed.
    Synth {
        #[arg(long)]
        out: PathBuf,
        /// Number of classes.
        #[arg(long, default_value_t = 10)]
        classes: u32,
        /// Training images (validation gets a fifth as many).
        #[arg(long, default_value_t = 2000)]
        images: u64,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// JPEG quality.
        #[arg(long, default_value_t = 90)]
        quality: u8,
        /// Target bytes per shard file.
        #[arg(long, default_value_t = 64 << 20)]
        shard_size: u64,
        /// Write an ImageFolder tree of JPEGs instead of shards (for PyTorch/FFCV comparisons).
        #[arg(long)]
        folder: bool,
        /// Worker threads (default: every core).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Check every byte of the shard set(s) in DIR: exit code 1 and a precise message on damage.
    Verify {
        /// A shard set, or a directory whose sub-folders are shard sets (train/, val/).
        dirs: Vec<PathBuf>,
    },
    /// Counts, sizes, classes and a few records of the shard set(s) in DIR.
    Inspect {
        dir: PathBuf,
        /// How many records to show per set.
        #[arg(long, default_value_t = 5)]
        records: u64,
    },
}

/// The exit code of a build refused because its output folder holds another build (other
/// inputs or options): `cargo xtask` clears its own cache on it and starts over.
const OTHER_BUILD: u8 = 3;

fn main() -> ExitCode {
    match run(Cli::parse().command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            match e.downcast_ref::<DataError>() {
                Some(DataError::OtherBuild { .. }) => ExitCode::from(OTHER_BUILD),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

fn run(command: Command) -> Result<()> {
    match command {
        Command::Build {
            from_folder,
            out,
            max_side,
            quality,
            shard_size,
            strict,
            threads,
            val_labels,
            val_synsets,
        } => {
            let options = ConvertOptions {
                max_side,
                quality,
                shard_bytes: shard_size,
                strict,
                threads: threads.unwrap_or_else(redline_datasets::all_cores),
                val_labels,
                val_synsets,
            };
            let summary = convert_folder(&from_folder, &out, &options)?;
            println!("classes: {}", summary.classes.len());
            for set in &summary.sets {
                println!(
                    "{}: {} images, {} in {} shard(s) -> {}",
                    if set.name.is_empty() {
                        "set"
                    } else {
                        &set.name
                    },
                    set.images,
                    human_bytes(set.bytes),
                    set.shards,
                    set.dir.display()
                );
            }
            println!("skipped: {}", summary.skipped.len());
            for s in &summary.skipped {
                println!("  {}: {}", s.path.display(), s.reason);
            }
            Ok(())
        }
        Command::Synth {
            out,
            classes,
            images,
            seed,
            quality,
            shard_size,
            folder,
            threads,
        } => {
            let options = SynthOptions {
                classes,
                images,
                seed,
                quality,
                shard_bytes: shard_size,
                threads: threads.unwrap_or_else(redline_datasets::all_cores),
            };
            if folder {
                synth_folder(&out, &options)?;
                println!("wrote an ImageFolder tree to {}", out.display());
            } else {
                for dir in synth_shards(&out, &options)? {
                    let set = ShardSet::open(&dir)?;
                    println!(
                        "{}: {} images, {} in {} shard(s)",
                        dir.display(),
                        set.len(),
                        human_bytes(set.manifest().bytes),
                        set.shards().len()
                    );
                }
            }
            Ok(())
        }
        Command::Verify { dirs } => {
            anyhow::ensure!(!dirs.is_empty(), "give at least one shard-set directory");
            for dir in dirs {
                for set_dir in set_dirs(&dir)? {
                    let set = ShardSet::open(&set_dir)?;
                    let report = set.verify()?;
                    println!(
                        "OK {}: {} shard(s), {} records, {} of records and {} of padding checked",
                        set_dir.display(),
                        set.shards().len(),
                        report.records,
                        human_bytes(report.record_bytes),
                        human_bytes(report.padding_bytes)
                    );
                }
            }
            Ok(())
        }
        Command::Inspect { dir, records } => {
            for set_dir in set_dirs(&dir)? {
                inspect(&set_dir, records)?;
            }
            Ok(())
        }
    }
}

/// `dir` itself when it holds a manifest, else its sub-folders that do.
fn set_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    if dir.join(MANIFEST_FILE).is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    let mut sets: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot read the directory", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join(MANIFEST_FILE).is_file())
        .collect();
    sets.sort();
    anyhow::ensure!(
        !sets.is_empty(),
        "{}: no {MANIFEST_FILE} here or in any sub-folder: not a shard set",
        dir.display()
    );
    Ok(sets)
}

fn inspect(dir: &Path, show: u64) -> Result<()> {
    let set = ShardSet::open(dir)?;
    let m = set.manifest();
    println!("{}", dir.display());
    println!("  schema:  {}", m.schema);
    println!(
        "  records: {} in {} shard(s), {}",
        set.len(),
        set.shards().len(),
        human_bytes(m.bytes)
    );
    let mut per_class = vec![0u64; m.classes.len()];
    let (mut unlabelled, mut record_bytes) = (0u64, 0u64);
    for shard in set.shards() {
        for i in 0..shard.len() {
            let e = shard.entry(i)?;
            record_bytes += e.length as u64;
            match per_class.get_mut(e.label.max(0) as usize) {
                Some(n) if e.label >= 0 => *n += 1,
                _ => unlabelled += 1,
            }
        }
    }
    if !set.is_empty() {
        println!(
            "  mean record: {} ({:.1}% of the files are records)",
            human_bytes(record_bytes / set.len()),
            100.0 * record_bytes as f64 / m.bytes.max(1) as f64
        );
    }
    println!("  classes: {}", m.classes.len());
    for (name, n) in m.classes.iter().zip(&per_class).take(20) {
        println!("    {name}: {n}");
    }
    if m.classes.len() > 20 {
        println!("    … {} more", m.classes.len() - 20);
    }
    if unlabelled > 0 {
        println!("  unlabelled: {unlabelled}");
    }
    if !m.params.is_empty() {
        println!("  params:  {}", serde_json::Value::Object(m.params.clone()));
    }
    for g in 0..show.min(set.len()) {
        let r = set.record(g)?;
        let class = m
            .classes
            .get(r.label.max(0) as usize)
            .filter(|_| r.label >= 0);
        println!(
            "  record {g}: {}#{} {:?} {}x{} {} label {} ({})",
            r.shard.file_name().unwrap_or_default().to_string_lossy(),
            r.index,
            r.encoding,
            r.width,
            r.height,
            human_bytes(r.bytes.len() as u64),
            r.label,
            class.map_or("none", |c| c.as_str())
        );
    }
    Ok(())
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
