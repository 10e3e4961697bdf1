//! `cargo xtask bench …`: runs a benchmark, then prints (and optionally saves) its table.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use crate::run;

#[derive(Subcommand)]
pub enum Bench {
    /// Shard reads: a full scan through the reader API next to memcpy of the same bytes, and
    /// random record access (criterion, `benches/benches/shards.rs`).
    Shards(BenchArgs),
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
    }
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
