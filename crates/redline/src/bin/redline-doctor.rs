//! `redline-doctor REPORT [--json]`: which of the four reasons a GPU idles holds in a run —
//! the loader, many short kernels issued by a host that cannot keep up, slow memory access,
//! synchronisations — with the evidence from the report and the fix. REPORT is
//! bench-imagenet's JSON or redline-train's. `cargo xtask doctor` drives it (and `--run`
//! measures a short bench first).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use redline_train::doctor::diagnose;

/// Names the bottleneck of a measured run, with its evidence and fix.
#[derive(Parser)]
#[command(name = "redline-doctor")]
struct Cli {
    /// A bench-imagenet or redline-train JSON report.
    report: PathBuf,
    /// Print the diagnosis as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let path = cli.report.display();
    let text = match std::fs::read_to_string(&cli.report) {
        Ok(text) => text,
        Err(e) => {
            eprintln!("redline-doctor: {path}: {e}");
            return ExitCode::from(2);
        }
    };
    let diagnosis = serde_json::from_str(&text)
        .map_err(|e| e.to_string())
        .and_then(|report| diagnose(&report).map_err(|e| e.to_string()));
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
