//! `bench-ops --device cpu|wgpu --out PATH [--only ROW]`: runs the op benchmark rows (`redline_benches::ops`)
//! and writes the results as JSON. On wgpu it runs the adapter-sized rows on the adapter and the
//! same rows on the CPU backend, in the same run. `cargo xtask bench ops` drives it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use redline_benches::ops::{measure, rows, Budget, Measured};
use redline_tensor::{Device, Result};
use serde_json::json;

/// The op benchmark rows on one device, as JSON.
#[derive(Parser)]
#[command(name = "bench-ops")]
struct Cli {
    /// cpu, or wgpu (its adapter-sized rows, and the same rows on the CPU in the same run).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "wgpu"])]
    device: String,
    /// The JSON report.
    #[arg(long)]
    out: PathBuf,
    /// Only the row with this name.
    #[arg(long)]
    only: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli.device, &cli.out, cli.only.as_deref()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench-ops: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(device: &str, out: &Path, only: Option<&str>) -> std::result::Result<(), String> {
    let cpu = redline_cpu::CpuBackend::device();
    let report = match device {
        "cpu" => {
            eprintln!(
                "cpu backend, {} threads",
                redline_cpu::CpuBackend::threads()
            );
            let results = run_rows(&cpu, false, only, Budget::Time(Duration::from_secs(2)))?;
            json!({"device": cpu.name(), "threads": redline_cpu::CpuBackend::threads(), "rows": rows_json(&results, None)})
        }
        "wgpu" => {
            let gpu = wgpu_device()?;
            eprintln!("wgpu adapter {}", gpu.name());
            // A software adapter runs at ~0.3 GFLOP/s: small rows, a fixed number of iterations.
            let on_gpu = run_rows(&gpu, true, only, Budget::Iterations(3))?;
            let on_cpu = run_rows(&cpu, true, only, Budget::Time(Duration::from_secs(1)))?;
            json!({"device": gpu.name(), "rows": rows_json(&on_gpu, Some(&on_cpu))})
        }
        other => return Err(format!("unknown device {other:?} (cpu or wgpu)")),
    };
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    std::fs::write(out, text + "\n").map_err(|e| format!("writing {}: {e}", out.display()))
}

fn run_rows(
    dev: &Device,
    small: bool,
    only: Option<&str>,
    budget: Budget,
) -> std::result::Result<Vec<Measured>, String> {
    let all = rows(small);
    if let Some(name) = only.filter(|o| !all.iter().any(|row| row.name == *o)) {
        let known: Vec<_> = all.iter().map(|row| row.name.as_str()).collect();
        return Err(format!(
            "--only {name}: no such row; the rows are {}",
            known.join(", ")
        ));
    }
    all.iter()
        .filter(|row| only.is_none_or(|o| row.name == o))
        .map(|row| -> Result<Measured> {
            let m = measure(row, dev, budget)?;
            eprintln!(
                "  {:<30} {:>9.1} GFLOP/s  (median {:.2} ms of {})",
                m.name, m.gflops, m.median_ms, m.iterations
            );
            Ok(m)
        })
        .collect::<Result<Vec<_>>>()
        .map_err(|e| format!("on {}: {e}", dev.name()))
}

fn rows_json(results: &[Measured], cpu: Option<&[Measured]>) -> serde_json::Value {
    results
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let mut row = json!({"name": m.name, "gflops": m.gflops, "median_ms": m.median_ms, "iterations": m.iterations});
            if let Some(c) = cpu.and_then(|c| c.get(i)) {
                row["cpu_gflops"] = json!(c.gflops);
            }
            row
        })
        .collect()
}

#[cfg(feature = "wgpu")]
fn wgpu_device() -> std::result::Result<Device, String> {
    let backend = redline_wgpu::WgpuBackend::new(|_| true).map_err(|e| e.to_string())?;
    Ok(Device::new(std::sync::Arc::new(backend)))
}

#[cfg(not(feature = "wgpu"))]
fn wgpu_device() -> std::result::Result<Device, String> {
    Err("built without the `wgpu` feature (cargo xtask bench ops --device wgpu enables it)".into())
}
