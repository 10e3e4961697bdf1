//! `redline-doctor REPORT... [--json]`: which of the four reasons a GPU idles holds in a run —
//! the loader, many short kernels issued by a host that cannot keep up, slow memory access,
//! synchronisations — with the evidence from the report and the fix. REPORT is
//! bench-imagenet's JSON, redline-train's or redline-gpu-check's; several gpu-check reports of
//! one pack on one GPU (a short window's runs) are judged as one. `cargo xtask doctor` drives
//! it (and `--run` measures a short bench first).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use redline_train::doctor::{diagnose, merge_gpu_checks};
use serde_json::Value;

/// Names the bottleneck of a measured run, with its evidence and fix.
#[derive(Parser)]
#[command(name = "redline-doctor")]
struct Cli {
    /// A bench-imagenet, redline-train or redline-gpu-check JSON report; several gpu-check
    /// reports (one pack's runs on one GPU) are merged.
    #[arg(required = true)]
    reports: Vec<PathBuf>,
    /// Print the diagnosis as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let names: Vec<String> = cli
        .reports
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let path = names.join(" + ");
    let mut reports = Vec::with_capacity(cli.reports.len());
    for (file, name) in cli.reports.iter().zip(&names) {
        let read = std::fs::read_to_string(file)
            .map_err(|e| e.to_string())
            .and_then(|text| serde_json::from_str::<Value>(&text).map_err(|e| e.to_string()));
        match read {
            Ok(report) => reports.push(report),
            Err(e) => {
                eprintln!("redline-doctor: {name}: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let report = match reports.len() {
        1 => Ok(reports.swap_remove(0)),
        _ => merge_gpu_checks(&reports).map_err(|e| e.to_string()),
    };
    let diagnosis = report.and_then(|r| diagnose(&r).map_err(|e| e.to_string()));
    match diagnosis {
        Ok(d) if cli.json => {
            println!("{:#}", d.to_json());
            ExitCode::SUCCESS
        }
        Ok(d) => {
            println!("{d}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("redline-doctor: {path}: {e}");
            ExitCode::from(2)
        }
    }
}
